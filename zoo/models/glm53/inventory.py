"""GLM-5.3's tensor inventory in llama.cpp ``glm5next`` names (see ``zoo.models.shared.inventory``)."""

from __future__ import annotations

from zoo.models.glm53.vision import gguf_tensors as vision_tensors
from zoo.models.shared.inventory import Tensor


def _glm_block(i: int, cfg, mixer: str, mlp: str, indexer: bool, mtp: bool) -> list[Tensor]:
    d, b = cfg.hidden_size, f"blk.{i}."
    c = (lambda cls: "mtp") if mtp else (lambda cls: cls)
    out = [Tensor(b + "attn_norm.weight", (d,), c("norms"), False),
           Tensor(b + "ffn_norm.weight", (d,), c("norms"), False)]
    if not mtp:
        n = cfg.hc_mult
        for s in ("attn", "ffn"):
            out += [Tensor(b + f"hc_{s}_fn.weight", ((2 + n) * n, n * d), "hyper_connections", False),
                    Tensor(b + f"hc_{s}_base.weight", ((2 + n) * n,), "hyper_connections", False),
                    Tensor(b + f"hc_{s}_scale.weight", (3,), "hyper_connections", False)]
    att = c("attention")
    if mixer == "linear_attention":
        h, dk = cfg.linear_num_heads, cfg.linear_head_dim
        out += [Tensor(b + f"attn_{p}.weight", (h * dk, d), att) for p in "qkv"]
        out += [Tensor(b + f"ssm_conv1d_{p}.weight", (h * dk, 1, cfg.linear_conv_kernel_dim), att, False)
                for p in "qkv"]
        out += [Tensor(b + "ssm_f_a.weight", (dk, d), att), Tensor(b + "ssm_f_b.weight", (h * dk, dk), att),
                Tensor(b + "ssm_a", (h,), att, False), Tensor(b + "ssm_dt.bias", (h * dk,), att, False),
                Tensor(b + "ssm_beta.weight", (h, d), att), Tensor(b + "ssm_g_a.weight", (dk, d), att),
                Tensor(b + "ssm_g_b.weight", (h * dk, dk), att), Tensor(b + "ssm_norm.weight", (dk,), att, False),
                Tensor(b + "attn_output.weight", (d, h * dk), att)]
    else:
        h, q, kv = cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank
        nope, v = cfg.qk_nope_head_dim, cfg.v_head_dim
        out += [Tensor(b + "attn_q_a.weight", (q, d), att), Tensor(b + "attn_q_a_norm.weight", (q,), att, False),
                Tensor(b + "attn_q_b.weight", (h * nope, q), att), Tensor(b + "attn_kv_a_mqa.weight", (kv, d), att),
                Tensor(b + "attn_kv_a_norm.weight", (kv,), att, False),
                Tensor(b + "attn_k_b.weight", (h, kv, nope), att), Tensor(b + "attn_v_b.weight", (h, v, kv), att),
                Tensor(b + "attn_output.weight", (d, h * v), att)]
        if indexer:
            hi, di = cfg.index_n_heads, cfg.index_head_dim
            out += [Tensor(b + "indexer.attn_q_b.weight", (hi * di, q), att),
                    Tensor(b + "indexer.attn_k.weight", (di, d), att),
                    Tensor(b + "indexer.k_norm.weight", (di,), att, False),
                    Tensor(b + "indexer.k_norm.bias", (di,), att, False),
                    Tensor(b + "indexer.proj.weight", (hi, d), att),
                    Tensor(b + "indexer_compressor_ape.weight", (cfg.index_kpool, di), att, False),
                    Tensor(b + "indexer_compressor_gate.weight", (di, d), att)]
    if mlp == "dense":
        i_ = cfg.intermediate_size
        return out + [Tensor(b + "ffn_gate.weight", (i_, d), c("mlp")), Tensor(b + "ffn_up.weight", (i_, d), c("mlp")),
                      Tensor(b + "ffn_down.weight", (d, i_), c("mlp"))]
    e, ie, sh = cfg.n_routed_experts, cfg.moe_intermediate_size, cfg.moe_intermediate_size * cfg.n_shared_experts
    return out + [
        Tensor(b + "ffn_gate_inp.weight", (e, d), c("router"), False),
        Tensor(b + "exp_probs_b.bias", (e,), c("router"), False),
        Tensor(b + "ffn_gate_exps.weight", (e, ie, d), c("routed_experts")),
        Tensor(b + "ffn_up_exps.weight", (e, ie, d), c("routed_experts")),
        Tensor(b + "ffn_down_exps.weight", (e, d, ie), c("routed_experts")),
        Tensor(b + "ffn_gate_shexp.weight", (sh, d), c("shared_experts")),
        Tensor(b + "ffn_up_shexp.weight", (sh, d), c("shared_experts")),
        Tensor(b + "ffn_down_shexp.weight", (d, sh), c("shared_experts"))]


def glm5next_tensors(cfg) -> list[Tensor]:
    """Every tensor of a ``glm5-next`` GGUF for a ``Glm53Config``; MTP blocks (MLA with a full
    indexer + MoE, no hyper-connections) after the main ones; with a vision tower (``cfg.vision``),
    its tensors last, class ``"vision"``, in llama.cpp's mmproj names (a separate file there)."""
    d, n = cfg.hidden_size, cfg.num_hidden_layers
    out = [Tensor("token_embd.weight", (cfg.vocab_size, d), "embedding", False),
           Tensor("output_norm.weight", (d,), "norms", False)]
    if not cfg.tie_word_embeddings:
        out.append(Tensor("output.weight", (cfg.vocab_size, d), "output"))
    for i in range(n):
        out += _glm_block(i, cfg, cfg.layer_types[i], cfg.mlp_layer_types[i],
                          cfg.indexer_types[i] == "full", mtp=False)
    for j in range(cfg.mtp_num_hidden_layers):
        b = f"blk.{n + j}.nextn."
        out += [Tensor(b + "eh_proj.weight", (d, 2 * d), "mtp")]
        out += [Tensor(b + f"{x}.weight", (d,), "mtp", False) for x in ("enorm", "hnorm", "shared_head_norm")]
        out += _glm_block(n + j, cfg, "indexed_attention", "sparse", True, mtp=True)
    if getattr(cfg, "vision", None) is not None:
        out += vision_tensors(cfg.vision, "vision")
    return out


tensors = glm5next_tensors
