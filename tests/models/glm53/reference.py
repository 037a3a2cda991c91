"""Reference side of the GLM-5.3 tests: tiny transformers ``Glm5NextForConditionalGeneration``
checkpoints (a 1-layer vision tower, text only) with realistic weights, written with
``save_pretrained`` plus the MTP layer transformers does not keep (``layers.{N}``), the margins of
the reference's discrete choices, and a plain numpy implementation of the MTP layer's published
structure (docs/reference.md section 1).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np
import torch
from safetensors import safe_open
from safetensors.numpy import save_file
from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=64,
              projection_intermediate_size=32)

TINY_CONFIGS = {
    # KDA, MLA (full indexer), MLA (shared indexer), KDA; dense then MoE; 8 experts top-2 + shared;
    # pools of 4, top 16 tokens; gate lower bound; tight SwiGLU clamp.
    "A": dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
              n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1,
              q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, v_head_dim=16,
              index_n_heads=8, index_head_dim=16, index_kpool=4, index_topk=16,
              linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, linear_lower_bound=-5.0,
              layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
              indexer_types=["full", "full", "shared", "full"],
              mlp_layer_types=["dense", "sparse", "sparse", "sparse"], swiglu_limit=1.0),
    # 6 layers, two full + one shared indexer layer (pools of 8, top 16), 16 experts top-4 in 2 groups
    # (best group only), unnormalised top-k weights, no decay lower bound (softplus gate), widths
    # above 128 (FP8 blocks), vocab 200.
    "B": dict(vocab_size=200, hidden_size=48, intermediate_size=160, moe_intermediate_size=24,
              num_hidden_layers=6, num_attention_heads=2, num_key_value_heads=2,
              n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=2, topk_group=1,
              norm_topk_prob=False, q_lora_rank=32, kv_lora_rank=24, qk_nope_head_dim=24, v_head_dim=8,
              index_n_heads=8, index_head_dim=16, index_kpool=8, index_topk=16,
              linear_num_heads=2, linear_head_dim=24, linear_conv_kernel_dim=3, linear_lower_bound=None,
              layer_types=["linear_attention", "linear_attention", "indexed_attention", "indexed_attention",
                           "linear_attention", "indexed_attention"],
              indexer_types=["full", "full", "full", "shared", "full", "full"],
              mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse", "sparse"], swiglu_limit=2.0),
}


def hf_config(name: str) -> Glm5NextConfig:
    text = dict(TINY_CONFIGS[name], pad_token_id=0, rms_norm_eps=1e-5, tie_word_embeddings=False)
    cfg = Glm5NextConfig(text_config=text, vision_config=VISION)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    return cfg


def redraw_(model: torch.nn.Module, seed: int) -> None:
    """Realistic spread: linears N(0, 1/fan_in), embeddings N(0, 1), norm weights near 1, decays,
    gates and biases O(0.5), router correction bias O(0.2) (so it changes some choices)."""
    g = torch.Generator().manual_seed(seed)
    rand = lambda p, s=1.0, m=0.0: m + s * torch.randn(p.shape, generator=g)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 4.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(rand(p, 1.0, -2.0))
            elif name.endswith("hc.base") or name.endswith("compress_ape") or name.endswith("k_norm.bias"):
                p.copy_(rand(p, 0.5))
            elif name.endswith("hc.scale"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 1.5, generator=g))
            elif "norm" in name:
                p.copy_(rand(p, 0.2, 1.0))
            elif "conv1d" in name:
                p.copy_(rand(p, p.shape[-1] ** -0.5))
            elif "embed_tokens" in name:
                p.copy_(rand(p))
            else:
                p.copy_(rand(p, p.shape[-1] ** -0.5))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(rand(b, 0.2))


def mtp_tensors(cfg, seed: int, with_copies: bool) -> dict[str, np.ndarray]:
    """On-disk ``model.language_model.layers.{N}.*`` tensors of one MTP layer, realistic spread.

    ``with_copies`` adds the MTP layer's own copies of the embedding and head (the loader ignores them).
    """
    rng = np.random.default_rng(seed)
    d, h, c, ql = cfg.hidden_size, cfg.num_attention_heads, cfg.kv_lora_rank, cfg.q_lora_rank
    dn, dv, hi, di = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.index_n_heads, cfg.index_head_dim
    e, inter = cfg.n_routed_experts, cfg.moe_intermediate_size
    lin = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
    norm = lambda n: (1.0 + 0.2 * rng.standard_normal(n)).astype(np.float32)
    vec = lambda n, s: (s * rng.standard_normal(n)).astype(np.float32)
    t = {"eh_proj.weight": lin(d, 2 * d), "enorm.weight": norm(d), "hnorm.weight": norm(d),
         "shared_head.norm.weight": norm(d), "input_layernorm.weight": norm(d),
         "post_attention_layernorm.weight": norm(d),
         "self_attn.q_a_proj.weight": lin(ql, d), "self_attn.q_a_layernorm.weight": norm(ql),
         "self_attn.q_b_proj.weight": lin(h * dn, ql), "self_attn.kv_a_proj_with_mqa.weight": lin(c, d),
         "self_attn.kv_a_layernorm.weight": norm(c), "self_attn.kv_b_proj.weight": lin(h * (dn + dv), c),
         "self_attn.o_proj.weight": lin(d, h * dv),
         "self_attn.indexer.wq_b.weight": lin(hi * di, ql), "self_attn.indexer.wk.weight": lin(di, d),
         "self_attn.indexer.k_norm.weight": norm(di), "self_attn.indexer.k_norm.bias": vec(di, 0.5),
         "self_attn.indexer.weights_proj.weight": lin(hi, d),
         "self_attn.indexer.index_kpool_compress_gate": lin(di, d),
         "self_attn.indexer.index_kpool_compress_ape": vec((cfg.index_kpool, di), 0.5),
         "mlp.gate.weight": lin(e, d), "mlp.gate.e_score_correction_bias": vec(e, 0.2),
         "mlp.shared_experts.gate_proj.weight": lin(inter * cfg.n_shared_experts, d),
         "mlp.shared_experts.up_proj.weight": lin(inter * cfg.n_shared_experts, d),
         "mlp.shared_experts.down_proj.weight": lin(d, inter * cfg.n_shared_experts)}
    for i in range(e):
        t.update({f"mlp.experts.{i}.gate_proj.weight": lin(inter, d), f"mlp.experts.{i}.up_proj.weight": lin(inter, d),
                  f"mlp.experts.{i}.down_proj.weight": lin(d, inter)})
    if with_copies:
        t.update({"embed_tokens.weight": vec((cfg.vocab_size, d), 1.0),
                  "shared_head.head.weight": lin(cfg.vocab_size, d)})
    return {f"model.language_model.layers.{cfg.num_hidden_layers}.{k}": v for k, v in t.items()}


def read_all(path: Path) -> dict[str, np.ndarray]:
    out = {}
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), "np") as h:
            out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


def write_flat(path: Path, tensors: dict[str, np.ndarray], text_config: dict) -> None:
    """A text-only checkpoint: ``model.*`` names, one file, flat ``glm5_next_text`` config.json."""
    for f in list(path.glob("*.safetensors")) + list(path.glob("*.index.json")):
        f.unlink()
    flat = {k.replace("model.language_model.", "model."): v for k, v in tensors.items() if "visual" not in k}
    save_file(flat, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({**text_config, "model_type": "glm5_next_text"}))


def write_checkpoint(path: Path, name: str, seed: int, flat: bool = False) -> Glm5NextForConditionalGeneration:
    """save_pretrained a redrawn tiny model into ``path`` plus its MTP layer; returns the torch model.

    ``flat=False``: the multimodal layout (sharded, ``model.language_model.*``, nested config that
    declares ``num_nextn_predict_layers``). ``flat=True``: text only, ``model.*``, flat config that
    does not mention the MTP layer (the loader finds it in the weights).
    """
    torch.manual_seed(seed)
    model = Glm5NextForConditionalGeneration(hf_config(name)).eval()
    redraw_(model, seed)
    model.save_pretrained(path, max_shard_size="200KB")
    mtp = mtp_tensors(model.config.text_config, seed + 1, with_copies=not flat)
    cfg = json.loads((path / "config.json").read_text())
    if flat:
        write_flat(path, {**read_all(path), **mtp}, cfg["text_config"])
        return model
    save_file(mtp, str(path / "model-mtp.safetensors"))
    index_path = path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
    index_path.write_text(json.dumps(index))
    cfg["text_config"]["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(cfg))
    return model


# -- running the reference ------------------------------------------------------------------------
def _topk_margin(values: torch.Tensor, k: int) -> float:
    """Smallest gap between the k-th and (k+1)-th largest entry over all rows (masked entries, at
    the dtype minimum, never count as the (k+1)-th)."""
    if values.shape[-1] <= k:
        return float("inf")
    top = values.float().topk(k + 1, dim=-1).values
    real = top[..., k] > torch.finfo(values.dtype).min / 2
    gaps = (top[..., k - 1] - top[..., k])[real]
    return float(gaps.min()) if gaps.numel() else float("inf")


@contextlib.contextmanager
def record_margins(model):
    """Collect the reference's discrete-choice margins during a forward: ``{"router", "indexer"}``."""
    margins = {"router": float("inf"), "indexer": float("inf")}
    handles, active = [], []
    orig_topk = torch.Tensor.topk

    def topk(self, k, *args, **kwargs):
        if active and self.dim() == 3 and self.shape[1] > 1:          # the indexer's pool scores
            margins["indexer"] = min(margins["indexer"], _topk_margin(self, k))
        return orig_topk(self, k, *args, **kwargs)

    for module in model.modules():
        kind = type(module).__name__
        if kind.endswith("TopkRouter"):
            def hook(mod, _inp, out):
                scores = out[0].float().sigmoid() + mod.e_score_correction_bias
                margins["router"] = min(margins["router"], _topk_margin(scores, mod.top_k))
            handles.append(module.register_forward_hook(hook))
        elif kind.endswith("Indexer"):
            handles.append(module.register_forward_pre_hook(lambda *_: active.append(1) and None))
            handles.append(module.register_forward_hook(lambda *_: active.pop() and None))
    torch.Tensor.topk = topk
    try:
        yield margins
    finally:
        torch.Tensor.topk = orig_topk
        for h in handles:
            h.remove()


def torch_forward(model, ids: np.ndarray, mask: np.ndarray | None = None):
    """(logits [B, S, V], post-norm hidden [B, S, D], margins) of the transformers model."""
    kwargs = {} if mask is None else {"attention_mask": torch.as_tensor(mask, dtype=torch.long)}
    with torch.no_grad(), record_margins(model) as margins:
        hidden = model.model(input_ids=torch.as_tensor(ids, dtype=torch.long), **kwargs).last_hidden_state
        logits = model.lm_head(hidden)
    return logits.float().numpy(), hidden.float().numpy(), margins


# -- numpy MTP (the published structure, docs/reference.md section 1) ------------------------------------
def _rms(x, w, eps):
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * w


def _layernorm(x, w, b, eps=1e-6):
    mu = x.mean(-1, keepdims=True)
    return (x - mu) / np.sqrt(((x - mu) ** 2).mean(-1, keepdims=True) + eps) * w + b


def _softmax(x, axis=-1):
    e = np.exp(x - x.max(axis, keepdims=True))
    return e / e.sum(axis, keepdims=True)


def _silu(x):
    return x / (1.0 + np.exp(-x))


def _mla_with_indexer(x, t, cfg, margins):
    """Causal NoPE MLA over one sequence x [S, D], attending to the indexer's choice per query."""
    s, eps = x.shape[0], cfg.rms_norm_eps
    h, dn, dv, p = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.index_kpool
    hi, di = cfg.index_n_heads, cfg.index_head_dim
    q_resid = _rms(x @ t["self_attn.q_a_proj.weight"].T, t["self_attn.q_a_layernorm.weight"], eps)
    q = (q_resid @ t["self_attn.q_b_proj.weight"].T).reshape(s, h, dn)
    c = _rms(x @ t["self_attn.kv_a_proj_with_mqa.weight"].T, t["self_attn.kv_a_layernorm.weight"], eps)
    kv = (c @ t["self_attn.kv_b_proj.weight"].T).reshape(s, h, dn + dv)
    k, v = kv[..., :dn], kv[..., dn:]
    ix = "self_attn.indexer."
    qi = (q_resid @ t[ix + "wq_b.weight"].T).reshape(s, hi, di)
    ki = _layernorm(x @ t[ix + "wk.weight"].T, t[ix + "k_norm.weight"], t[ix + "k_norm.bias"])
    gi = x @ t[ix + "index_kpool_compress_gate"].T
    w = (x @ t[ix + "weights_proj.weight"].T) * hi ** -0.5
    out = np.zeros((s, h, dv))
    for i in range(s):
        n_pools = (i + 1) // p
        keys = [(_softmax(gi[j * p:(j + 1) * p] + t[ix + "index_kpool_compress_ape"], 0)
                 * ki[j * p:(j + 1) * p]).sum(0) for j in range(n_pools)]
        scores = np.array([(w[i] * np.maximum(qi[i] @ kj * di ** -0.5, 0)).sum() for kj in keys])
        keep = cfg.index_topk // p
        best = np.argsort(-scores, kind="stable")[:keep]
        if n_pools > keep:
            ranked = np.sort(scores)[::-1]
            margins["indexer"] = min(margins["indexer"], ranked[keep - 1] - ranked[keep])
        tokens = [tok for j in best for tok in range(j * p, (j + 1) * p)]
        tokens += list(range(i + 1 - (i + 1) % p, i + 1))
        for head in range(h):
            pr = _softmax(k[tokens, head] @ q[i, head] * dn ** -0.5)
            out[i, head] = pr @ v[tokens, head]
    return out.reshape(s, h * dv) @ t["self_attn.o_proj.weight"].T


def _moe(x, t, cfg, margins):
    """Sigmoid router (bias chooses, scores weigh) over stacked experts + shared expert; x [S, D]."""
    lim, k = cfg.swiglu_limit, cfg.num_experts_per_tok

    def swiglu(z, gate, up, down):
        return (_silu(np.minimum(z @ gate.T, lim)) * np.clip(z @ up.T, -lim, lim)) @ down.T

    scores = 1.0 / (1.0 + np.exp(-(x @ t["mlp.gate.weight"].T)))
    choice = scores + t["mlp.gate.e_score_correction_bias"]
    out = np.zeros_like(x)
    for n in range(x.shape[0]):
        ranked = np.sort(choice[n])[::-1]
        margins["router"] = min(margins["router"], ranked[k - 1] - ranked[k])
        ids = np.argsort(-choice[n], kind="stable")[:k]
        wts = scores[n, ids] / (scores[n, ids].sum() + 1e-20) * cfg.routed_scaling_factor
        for e, wt in zip(ids, wts):
            ex = f"mlp.experts.{e}."
            out[n] += wt * swiglu(x[n], t[ex + "gate_proj.weight"], t[ex + "up_proj.weight"],
                                  t[ex + "down_proj.weight"])
    sh = "mlp.shared_experts."
    return out + swiglu(x, t[sh + "gate_proj.weight"], t[sh + "up_proj.weight"], t[sh + "down_proj.weight"])


def numpy_mtp_logits(ids: np.ndarray, hidden: np.ndarray, embed: np.ndarray, lm_head: np.ndarray,
                     mtp: dict[str, np.ndarray], cfg) -> tuple[np.ndarray, dict]:
    """([B, S-1, V], margins): row t = head(shared_head.norm(block(eh_proj([enorm(embed(x_{t+1})),
    hnorm(h_t)])))), block = x + MLA(+full indexer)(input_norm(x)); x + MoE(post_norm(x)).

    Written for the normalised-top-k, single-group router of config "A".
    """
    assert cfg.norm_topk_prob and cfg.n_group == 1
    eps = cfg.rms_norm_eps
    prefix = f"model.language_model.layers.{cfg.num_hidden_layers}."
    t = {k[len(prefix):]: v.astype(np.float64) for k, v in mtp.items()}
    margins = {"router": np.inf, "indexer": np.inf}
    out = []
    for b in range(ids.shape[0]):
        e = _rms(embed[ids[b, 1:]].astype(np.float64), t["enorm.weight"], eps)
        h = _rms(hidden[b, :-1].astype(np.float64), t["hnorm.weight"], eps)
        x = np.concatenate([e, h], -1) @ t["eh_proj.weight"].T
        x = x + _mla_with_indexer(_rms(x, t["input_layernorm.weight"], eps), t, cfg, margins)
        x = x + _moe(_rms(x, t["post_attention_layernorm.weight"], eps), t, cfg, margins)
        out.append(_rms(x, t["shared_head.norm.weight"], eps) @ lm_head.T.astype(np.float64))
    return np.stack(out).astype(np.float32), margins


def redraw_vision_(visual: torch.nn.Module, seed: int) -> None:
    """A vision tower at a realistic spread: linears / convs N(0, 1/fan_in), norm weights near 1,
    biases O(0.3) (the tower and multimodal tests, the server fixtures)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in visual.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                p.copy_(0.3 * noise)
            else:
                p.copy_(noise / np.sqrt(np.prod(p.shape[1:])))
