"""Qwen3.8's tensor inventory in llama.cpp ``qwen35`` names (see ``zoo.models.shared.inventory``), and
the vision tower's in llama.cpp's mmproj names (class ``vision``) when the config has one."""

from __future__ import annotations

from zoo.models.qwen38.vision import VisionConfig, gguf_patch_parts
from zoo.models.shared.inventory import Tensor


def vision_tensors(v: VisionConfig) -> list[Tensor]:
    """The tower's tensors as llama.cpp's mmproj stores them (``zoo.models.qwen38.vision.gguf_rules``):
    the Conv3d patch kernel as T Conv2d kernels ``[D, C, P, P]``, matrices ``[out, in]``."""
    d, c, p, i_ = v.hidden_size, v.in_channels, v.patch_size, v.intermediate_size
    md, o = v.merged_dim, v.out_hidden_size
    t = lambda name, shape, matmul=False: Tensor(name, shape, "vision", matmul)      # noqa: E731
    out = [t(name, (d, c, p, p)) for name in gguf_patch_parts(v)]
    out += [t("v.patch_embd.bias", (d,)), t("v.position_embd.weight", (v.num_position_embeddings, d))]
    for i in range(v.depth):
        b = f"v.blk.{i}."
        out += [t(b + f"{n}.{w}", (d,)) for n in ("ln1", "ln2") for w in ("weight", "bias")]
        out += [t(b + "attn_qkv.weight", (3 * d, d), True), t(b + "attn_qkv.bias", (3 * d,)),
                t(b + "attn_out.weight", (d, d), True), t(b + "attn_out.bias", (d,)),
                t(b + "ffn_up.weight", (i_, d), True), t(b + "ffn_up.bias", (i_,)),
                t(b + "ffn_down.weight", (d, i_), True), t(b + "ffn_down.bias", (d,))]
    out += [t("v.post_ln.weight", (d,)), t("v.post_ln.bias", (d,)),
            t("mm.0.weight", (md, md), True), t("mm.0.bias", (md,)),
            t("mm.2.weight", (o, md), True), t("mm.2.bias", (o,))]
    return out


def _qwen35_block(i: int, cfg, linear: bool, mtp: bool) -> list[Tensor]:
    d, hd, b = cfg.hidden_size, cfg.head_dim, f"blk.{i}."
    nk, nv, dk, dv = (cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                      cfg.linear_value_head_dim)
    c = (lambda cls: "mtp") if mtp else (lambda cls: cls)
    att = c("attention")
    out = [Tensor(b + "attn_norm.weight", (d,), c("norms"), False),
           Tensor(b + "post_attention_norm.weight", (d,), c("norms"), False)]
    if linear:
        conv = 2 * nk * dk + nv * dv
        out += [Tensor(b + "attn_qkv.weight", (conv, d), att), Tensor(b + "attn_gate.weight", (nv * dv, d), att),
                Tensor(b + "ssm_beta.weight", (nv, d), att), Tensor(b + "ssm_alpha.weight", (nv, d), att),
                Tensor(b + "ssm_conv1d.weight", (conv, cfg.linear_conv_kernel_dim), att, False),
                Tensor(b + "ssm_a", (nv,), att, False), Tensor(b + "ssm_dt.bias", (nv,), att, False),
                Tensor(b + "ssm_norm.weight", (dv,), att, False), Tensor(b + "ssm_out.weight", (d, nv * dv), att)]
    else:
        h, kv = cfg.num_attention_heads, cfg.num_key_value_heads
        out += [Tensor(b + "attn_q.weight", (2 * h * hd, d), att), Tensor(b + "attn_k.weight", (kv * hd, d), att),
                Tensor(b + "attn_v.weight", (kv * hd, d), att), Tensor(b + "attn_output.weight", (d, h * hd), att),
                Tensor(b + "attn_q_norm.weight", (hd,), att, False),
                Tensor(b + "attn_k_norm.weight", (hd,), att, False)]
    i_ = cfg.intermediate_size
    return out + [Tensor(b + "ffn_gate.weight", (i_, d), c("mlp")), Tensor(b + "ffn_up.weight", (i_, d), c("mlp")),
                  Tensor(b + "ffn_down.weight", (d, i_), c("mlp"))]


def qwen35_tensors(cfg) -> list[Tensor]:
    """Every tensor of a ``qwen35`` GGUF for a ``Qwen38Config`` (MTP blocks after the main ones), then
    the vision tower's (``vision_tensors``) when the config has one."""
    d, n = cfg.hidden_size, cfg.num_hidden_layers
    out = [Tensor("token_embd.weight", (cfg.vocab_size, d), "embedding", False),
           Tensor("output_norm.weight", (d,), "norms", False)]
    if not cfg.tie_word_embeddings:
        out.append(Tensor("output.weight", (cfg.vocab_size, d), "output"))
    for i, lt in enumerate(cfg.layer_types):
        out += _qwen35_block(i, cfg, lt == "linear_attention", mtp=False)
    for j in range(cfg.mtp_num_hidden_layers):
        b = f"blk.{n + j}.nextn."
        out += [Tensor(b + "eh_proj.weight", (d, 2 * d), "mtp")]
        out += [Tensor(b + f"{x}.weight", (d,), "mtp", False) for x in ("enorm", "hnorm", "shared_head_norm")]
        out += _qwen35_block(n + j, cfg, False, mtp=True)
    if getattr(cfg, "vision", None) is not None:
        out += vision_tensors(cfg.vision)
    return out


tensors = qwen35_tensors
