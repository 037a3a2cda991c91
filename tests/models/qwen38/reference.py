"""Reference side of the Qwen3.8 tests: tiny transformers ``Qwen3_5ForCausalLM`` checkpoints with
realistic weights, written with ``save_pretrained`` (+ MTP tensors transformers does not keep), and a
plain numpy implementation of the MTP block's published structure.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

TINY_CONFIGS = {
    # 4 layers: 3 DeltaNet + 1 attention; GQA 4:2, DeltaNet 2 key / 4 value heads.
    "L4": dict(vocab_size=96, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
               num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=8, linear_conv_kernel_dim=4),
    # 8 layers: two attention layers, 1:3 kv grouping, wider rotary share, different dims.
    "L8": dict(vocab_size=128, hidden_size=48, intermediate_size=80, num_hidden_layers=8,
               num_attention_heads=6, num_key_value_heads=2, head_dim=16,
               linear_num_key_heads=1, linear_num_value_heads=3, linear_key_head_dim=8,
               linear_value_head_dim=16, linear_conv_kernel_dim=3,
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
}


def hf_config(name: str) -> Qwen3_5TextConfig:
    kw = dict(TINY_CONFIGS[name])
    kw.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
    cfg = Qwen3_5TextConfig(rms_norm_eps=1e-6, tie_word_embeddings=False, **kw)
    cfg._attn_implementation = "eager"
    return cfg


def redraw_(model: torch.nn.Module, seed: int) -> None:
    """Realistic spread: linears N(0, 1/fan_in), embeddings N(0, 1), norm weights near their
    identity (zero-centred ones near 0, plain ones near 1), decays and biases O(0.5)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.5, 8.0, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("linear_attn.norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif "norm" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif "conv1d" in name:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)


def mtp_tensors(cfg: Qwen3_5TextConfig, seed: int) -> dict[str, np.ndarray]:
    """HF-named ``mtp.*`` tensors (fc, the three norms, one full-attention layer), realistic spread."""
    rng = np.random.default_rng(seed)
    d, hd = cfg.hidden_size, cfg.head_dim
    lin = lambda o, i: (rng.standard_normal((o, i)) / np.sqrt(i)).astype(np.float32)
    norm = lambda n: (0.2 * rng.standard_normal(n)).astype(np.float32)
    p = "mtp.layers.0."
    return {
        "mtp.fc.weight": lin(d, 2 * d),
        "mtp.pre_fc_norm_embedding.weight": norm(d),
        "mtp.pre_fc_norm_hidden.weight": norm(d),
        "mtp.norm.weight": norm(d),
        p + "input_layernorm.weight": norm(d),
        p + "post_attention_layernorm.weight": norm(d),
        p + "self_attn.q_proj.weight": lin(cfg.num_attention_heads * hd * 2, d),
        p + "self_attn.k_proj.weight": lin(cfg.num_key_value_heads * hd, d),
        p + "self_attn.v_proj.weight": lin(cfg.num_key_value_heads * hd, d),
        p + "self_attn.o_proj.weight": lin(d, cfg.num_attention_heads * hd),
        p + "self_attn.q_norm.weight": norm(hd),
        p + "self_attn.k_norm.weight": norm(hd),
        p + "mlp.gate_proj.weight": lin(cfg.intermediate_size, d),
        p + "mlp.up_proj.weight": lin(cfg.intermediate_size, d),
        p + "mlp.down_proj.weight": lin(d, cfg.intermediate_size),
    }


def write_checkpoint(path: Path, name: str, seed: int, nested: bool = False) -> Qwen3_5ForCausalLM:
    """save_pretrained a redrawn tiny model into ``path`` plus an ``mtp`` shard; returns the torch model.

    ``nested=True`` rewrites config.json in the multimodal form (text part under ``text_config``).
    """
    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(hf_config(name)).eval()
    redraw_(model, seed)
    model.save_pretrained(path, max_shard_size="200KB")
    mtp = mtp_tensors(model.config, seed + 1)
    save_file(mtp, str(path / "model-mtp.safetensors"))
    index_path = path / "model.safetensors.index.json"
    if not index_path.exists():  # a single-file save: make it a sharded checkpoint with an index
        single = path / "model.safetensors"
        from safetensors import safe_open
        with safe_open(str(single), "np") as f:
            keys = list(f.keys())
        index_path.write_text(json.dumps({"metadata": {}, "weight_map": {k: "model.safetensors" for k in keys}}))
    index = json.loads(index_path.read_text())
    index["weight_map"].update({k: "model-mtp.safetensors" for k in mtp})
    index_path.write_text(json.dumps(index))
    cfg = json.loads((path / "config.json").read_text())
    cfg["mtp_num_hidden_layers"] = 1
    if nested:
        cfg = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
               "text_config": {**cfg, "model_type": "qwen3_5_text"}}     # no tower: vision_config would add one
    (path / "config.json").write_text(json.dumps(cfg))
    return model


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids, dtype=torch.long)).logits.float().numpy()


def torch_hidden(model, ids: np.ndarray) -> np.ndarray:
    """The main model's final post-norm hidden states [B, S, D]."""
    with torch.no_grad():
        return model.model(torch.as_tensor(ids, dtype=torch.long)).last_hidden_state.float().numpy()


# -- numpy MTP (the published structure, docs/reference.md section 2) ------------------------------------
def _rms(x, w, eps):      # zero-centred Qwen RMSNorm
    return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * (1.0 + w)


def _attention_layer(x, t, cfg, eps):
    """One gated full-attention decoder layer on x [S, D] (single sequence), weights t[...]."""
    s, d = x.shape
    hd, nh, nkv = cfg.head_dim, cfg.num_attention_heads, cfg.num_key_value_heads
    rd = int(hd * cfg.rope_parameters.get("partial_rotary_factor", 0.25))
    theta = cfg.rope_parameters["rope_theta"]
    h = _rms(x, t["input_layernorm.weight"], eps)
    qg = (h @ t["self_attn.q_proj.weight"].T).reshape(s, nh, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(s, nh * hd)
    k = (h @ t["self_attn.k_proj.weight"].T).reshape(s, nkv, hd)
    v = (h @ t["self_attn.v_proj.weight"].T).reshape(s, nkv, hd)
    q, k = _rms(q, t["self_attn.q_norm.weight"], eps), _rms(k, t["self_attn.k_norm.weight"], eps)
    inv = 1.0 / theta ** (np.arange(0, rd, 2) / rd)
    ang = np.arange(s)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]

    def rope(z):
        r, rest = z[..., :rd], z[..., rd:]
        rot = np.concatenate([-r[..., rd // 2:], r[..., :rd // 2]], -1)
        return np.concatenate([r * cos + rot * sin, rest], -1)

    q, k = rope(q), rope(k)
    rep = nh // nkv
    out = np.zeros((s, nh, hd))
    causal = np.tril(np.ones((s, s), bool))
    for head in range(nh):
        sc = q[:, head] @ k[:, head // rep].T / np.sqrt(hd)
        sc = np.where(causal, sc, -np.inf)
        pr = np.exp(sc - sc.max(-1, keepdims=True))
        out[:, head] = (pr / pr.sum(-1, keepdims=True)) @ v[:, head // rep]
    o = out.reshape(s, nh * hd) * (1.0 / (1.0 + np.exp(-gate)))
    x = x + o @ t["self_attn.o_proj.weight"].T
    h = _rms(x, t["post_attention_layernorm.weight"], eps)
    g, u = h @ t["mlp.gate_proj.weight"].T, h @ t["mlp.up_proj.weight"].T
    return x + (g / (1.0 + np.exp(-g)) * u) @ t["mlp.down_proj.weight"].T


def numpy_mtp_logits(ids: np.ndarray, hidden: np.ndarray, embed: np.ndarray, lm_head: np.ndarray,
                     mtp: dict[str, np.ndarray], cfg) -> np.ndarray:
    """[B, S-1, V]: row t = head(norm(layer(fc([enorm(embed(x_{t+1})), hnorm(h_t)]))))."""
    eps = cfg.rms_norm_eps
    layer = {k[len("mtp.layers.0."):]: v.astype(np.float64) for k, v in mtp.items() if k.startswith("mtp.layers.0.")}
    out = []
    for b in range(ids.shape[0]):
        e = _rms(embed[ids[b, 1:]].astype(np.float64), mtp["mtp.pre_fc_norm_embedding.weight"], eps)
        h = _rms(hidden[b, :-1].astype(np.float64), mtp["mtp.pre_fc_norm_hidden.weight"], eps)
        u = np.concatenate([e, h], -1) @ mtp["mtp.fc.weight"].T.astype(np.float64)
        u = _attention_layer(u, layer, cfg, eps)
        out.append(_rms(u, mtp["mtp.norm.weight"], eps) @ lm_head.T.astype(np.float64))
    return np.stack(out).astype(np.float32)


def redraw_vision_(model: torch.nn.Module, seed: int) -> None:
    """A vision tower at a realistic spread: matrices N(0, 1/fan_in), norm weights near 1, biases
    O(0.2), the position table N(0, 1) (the tower and multimodal tests, the server fixtures)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            elif name.endswith("bias"):
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
            elif name == "pos_embed.weight":
                p.copy_(torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) / np.sqrt(p[0].numel()))
