"""Qwen3.8-27B (HF ``qwen3_5``) assembled from the parts in ``zoo.models``.

    ids [B, T] -> embed -> N x DecoderLayer -> final norm (zero-centred) -> lm_head -> logits [B, T, V]
    with images (``mm``, ``zoo.models.qwen38.multimodal``): embed -> where(is_image, tower rows, embed)
    and the full-attention layers rotate by 3-axis (t, h, w) positions (interleaved M-RoPE)
    DecoderLayer: x += mixer(input_layernorm(x));  x += mlp(post_attention_layernorm(x))
    mixer: GatedDeltaNet where layer_types[i] == "linear_attention", GatedAttention otherwise.

The forward takes and returns an explicit cache (``init_cache``, the model contract of
``zoo.models.contract``), so one code path serves a full forward (a fresh cache as long as the
input), prefill, one-token decode and k-token verify::

    ModelCache(slots=SlotMeta(index, pos, valid),            shared attention bookkeeping
               layers=(KVCache(k, v) | DeltaNetCache(conv, state), ...),   one per layer
               mtp=MTPCache(slots=SlotMeta, layers=(KVCache,)))           when there is an MTP layer

The vision tower (``visual``, ``zoo.models.qwen38.vision.VisionTower``) is there when
``config.vision`` is set: ``encode_images(patches, grid_thw)`` gives the rows the image tokens take
(``image_geometry`` + ``encode_images_padded``: the same rows from one program per padded size).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.models.qwen38.config import Qwen38Config
from zoo.models.qwen38.gated_attention import (
    GatedAttention,
    SlotMeta,
    Slots,
    advance_slots,
    empty_slot_meta,
    rollback_slots,
)
from zoo.models.qwen38.gated_deltanet import GatedDeltaNet
from zoo.models.qwen38.multimodal import MMInputs
from zoo.models.qwen38.vision import VisionTower
from zoo.models.shared.cache import ModelCache
from zoo.models.shared.causal_lm import CausalLM, graph_dtype
from zoo.models.shared.layers import Embed, Linear, RMSNorm, SwiGLU, multi_axis_rotary_tables, rotary_tables
from zoo.models.shared.mtp import MTPHead


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Qwen38Config, layer_type: str, *, dtype):
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, zero_centered=True)
        self.layer_type = layer_type
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        if layer_type == "linear_attention":
            self.linear_attn = GatedDeltaNet(cfg, dtype=dtype)
        else:
            self.self_attn = GatedAttention(cfg, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=dtype)

    def init_cache(self, batch: int, length: int):
        if self.layer_type == "linear_attention":
            return self.linear_attn.init_cache(batch)
        return self.self_attn.init_cache(batch, length)

    def select_step(self, cache, idx):
        return GatedDeltaNet.select_step(cache, idx) if self.layer_type == "linear_attention" else cache

    def __call__(self, x, mask, slots: Slots, cache, keep_steps: bool = False):
        h = self.input_layernorm(x)
        if self.layer_type == "linear_attention":
            h, cache = self.linear_attn(h, mask, cache, keep_steps)
        else:
            h, cache = self.self_attn(h, slots, cache)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Qwen38(CausalLM):
    """The Qwen3.8 causal LM with its optional MTP head and optional vision tower (``visual``)."""

    def __init__(self, cfg: Qwen38Config, *, dtype=jnp.bfloat16):
        dtype = graph_dtype(dtype)
        if cfg.vision is not None and cfg.vision.out_hidden_size != cfg.hidden_size:
            raise ValueError(f"the vision tower's out_hidden_size {cfg.vision.out_hidden_size} is not the text "
                             f"model's hidden_size {cfg.hidden_size}")
        self.config = cfg
        self.dtype = dtype
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, zero_centered=True)
        self.embed_tokens = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, lt, dtype=dtype) for lt in cfg.layer_types])
        self.norm = RMSNorm(cfg.hidden_size, **norm)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            cfg.hidden_size, cfg.vocab_size, axes=("embed", "vocab"), dtype=dtype)
        self.mtp = MTPHead(
            embed_norm=RMSNorm(cfg.hidden_size, **norm), hidden_norm=RMSNorm(cfg.hidden_size, **norm),
            dim=cfg.hidden_size, block=DecoderLayer(cfg, "full_attention", dtype=dtype),
            final_norm=RMSNorm(cfg.hidden_size, **norm), dtype=dtype) if cfg.mtp_num_hidden_layers else None
        self.visual = None if cfg.vision is None else VisionTower(cfg.vision, dtype=dtype)

    # -- position bookkeeping (``CausalLM``) ------------------------------------------------------
    empty_meta = staticmethod(empty_slot_meta)
    rollback_meta = staticmethod(rollback_slots)

    def advance(self, meta: SlotMeta, mask: jax.Array, positions: jax.Array | None = None
                ) -> tuple[Slots, SlotMeta]:
        """The ``Slots`` of a call of ``mask [B, T]`` and the new bookkeeping. ``positions [3, B, T]``
        (absolute M-RoPE positions): the rotary follows them, and each row's next position becomes
        max(its position over the call's real tokens) + 1 (never less than before; a row with no
        real token keeps it); without them the positions count the real tokens."""
        fields, counted, new_meta = advance_slots(meta, mask)
        cfg = self.config
        if positions is None:
            cos, sin = rotary_tables(counted, cfg.rotary_dim, cfg.rope_theta)
            return Slots(cos=cos, sin=sin, **fields), new_meta
        positions = positions.astype(jnp.int32)
        cos, sin = multi_axis_rotary_tables(positions, cfg.rotary_dim, cfg.rope_theta, cfg.rotary_axes)
        last = jnp.max(jnp.where(mask[None], positions, -1), axis=(0, 2))              # [B]
        pos = jnp.where(mask.any(axis=1), jnp.maximum(meta.pos, last + 1), meta.pos)
        return Slots(cos=cos, sin=sin, **fields), new_meta.replace(pos=pos)

    # -- images ----------------------------------------------------------------------------
    def encode_images(self, patches: jax.Array, grid_thw) -> jax.Array:
        """patches [N, C*T*P*P] (HF ``pixel_values``), grid_thw static ((t, h, w), ...) -> the rows the
        image tokens take, [N / m^2, D] in the model dtype, image by image (``vision.merged_lengths``)."""
        if self.visual is None:
            raise ValueError("this model has no vision tower (config.vision is None)")
        merged, _ = self.visual(patches, grid_thw)
        return merged.astype(self.dtype)

    # -- forward ----------------------------------------------------------------------------
    def __call__(self, ids: jax.Array, mask: jax.Array, cache: ModelCache, keep_steps: bool = False,
                 mm: MMInputs | None = None):
        """ids, mask [B, T] -> (logits f32 [B, T, V], post-norm hidden [B, T, D], new cache).

        ``keep_steps``: recurrent layers keep their state after every token (see ``rollback``).
        ``mm``: image rows and M-RoPE positions (``zoo.models.qwen38.multimodal.MMInputs``): a token
        with ``mm.is_image`` takes ``mm.rows`` instead of its embedding; ``mm.positions`` (if not
        None) are the tokens' absolute (t, h, w) rotary positions (``advance``)."""
        mask = mask.astype(bool)
        x = self.embed_tokens(ids)
        positions = None
        if mm is not None:
            x = jnp.where(mm.is_image[..., None], mm.rows.astype(x.dtype), x)
            positions = mm.positions
        slots, meta = self.advance(cache.slots, mask, positions)
        new_layers = []
        for layer, layer_cache in zip(self.layers, cache.layers):
            x, layer_cache = layer(x, mask, slots, layer_cache, keep_steps)
            new_layers.append(layer_cache)
        hidden = self.norm(x)
        return self.head(hidden), hidden, cache.replace(slots=meta, layers=tuple(new_layers))


MODEL = Qwen38
