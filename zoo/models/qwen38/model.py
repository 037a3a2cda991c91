"""Qwen3.8-27B (HF ``qwen3_5`` text model) assembled from the parts in ``zoo.models``.

    ids [B, T] -> embed -> N x DecoderLayer -> final norm (zero-centred) -> lm_head -> logits [B, T, V]
    DecoderLayer: x += mixer(input_layernorm(x));  x += mlp(post_attention_layernorm(x))
    mixer: GatedDeltaNet where layer_types[i] == "linear_attention", GatedAttention otherwise.

The forward takes and returns an explicit cache pytree (``init_cache``), so one code path serves a
full forward (a fresh cache as long as the input), prefill, one-token decode and k-token verify::

    cache = {"slots": {"index", "pos", "valid"},          shared attention bookkeeping
             "layers": [ {"k", "v"} | {"conv", "state"} ],  one entry per layer
             "mtp": {"slots": ..., "layers": [{"k", "v"}]}}   when the model has an MTP layer
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.models.qwen38.config import Qwen38Config
from zoo.models.qwen38.gated_attention import GatedAttention, Slots, advance_slots, empty_slot_meta, rollback_slots
from zoo.models.qwen38.gated_deltanet import GatedDeltaNet
from zoo.models.shared.layers import Embed, Linear, RMSNorm, SwiGLU, rotary_tables
from zoo.models.shared.mtp import MTPHead
from zoo.ops.matmul import matmul


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

    def init_cache(self, batch: int, length: int) -> dict:
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


class Qwen38(nnx.Module):
    """The Qwen3.8 causal LM (text part) with its optional MTP head."""

    def __init__(self, cfg: Qwen38Config, *, dtype=jnp.bfloat16):
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

    # -- caches -----------------------------------------------------------------------------
    def init_cache(self, batch: int, length: int) -> dict:
        """A zeroed cache for ``batch`` rows and ``length`` token slots."""
        cache = {"slots": empty_slot_meta(batch, length),
                 "layers": [layer.init_cache(batch, length) for layer in self.layers]}
        if self.mtp is not None:
            cache["mtp"] = {"slots": empty_slot_meta(batch, length),
                            "layers": [self.mtp.block.init_cache(batch, length)]}
        return cache

    def _slots(self, meta: dict, mask: jax.Array) -> tuple[Slots, dict]:
        fields, positions, meta = advance_slots(meta, mask)
        cos, sin = rotary_tables(positions, self.config.rotary_dim, self.config.rope_theta)
        return Slots(cos=cos, sin=sin, **fields), meta

    # -- forward ----------------------------------------------------------------------------
    def head(self, hidden: jax.Array) -> jax.Array:
        """Post-norm hidden [B, T, D] -> float32 logits [B, T, V] (the shared output head)."""
        w = self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head.kernel.get_value()
        axes = ("embed", "vocab") if self.lm_head is None else self.lm_head.kernel.axes   # layout on a mesh
        return matmul(hidden.astype(self.dtype), w, out_dtype=jnp.float32, axes=axes)

    def __call__(self, ids: jax.Array, mask: jax.Array, cache: dict, keep_steps: bool = False):
        """ids, mask [B, T] -> (logits f32 [B, T, V], post-norm hidden [B, T, D], new cache).

        ``keep_steps``: recurrent layers keep their state after every token (see ``rollback``)."""
        mask = mask.astype(bool)
        slots, meta = self._slots(cache["slots"], mask)
        x = self.embed_tokens(ids)
        new_layers = []
        for layer, layer_cache in zip(self.layers, cache["layers"]):
            x, layer_cache = layer(x, mask, slots, layer_cache, keep_steps)
            new_layers.append(layer_cache)
        hidden = self.norm(x)
        return self.head(hidden), hidden, {**cache, "slots": meta, "layers": new_layers}

    rollback_meta = staticmethod(rollback_slots)

    @staticmethod
    def mtp_restore(cache: dict, mark: dict) -> dict:
        """Undo MTP calls made since ``mark`` (an earlier ``cache["mtp"]``): the MTP layer is pure
        attention, so restoring its slot bookkeeping is enough (the KV slots are overwritten later)."""
        return {**cache, "mtp": {**cache["mtp"], "slots": mark["slots"]}}

    def rollback(self, cache: dict, before: dict, n_keep: jax.Array) -> dict:
        """Keep only the first ``n_keep[b]`` tokens of the last ``keep_steps`` call of each row.

        cache: the cache that call returned; before: its ``cache["slots"]`` as the call received it.
        Attention slots past the kept tokens become invalid (overwritten later); recurrent layers
        take their state after the last kept token.
        """
        layers = [layer.select_step(c, n_keep - 1) for layer, c in zip(self.layers, cache["layers"])]
        return {**cache, "slots": rollback_slots(before, cache["slots"], n_keep), "layers": layers}

    def mtp_forward(self, hidden: jax.Array, next_ids: jax.Array, mask: jax.Array, cache: dict):
        """MTP rows: hidden [B, T, D] (post-norm h_t), next_ids [B, T] (x_{t+1}), mask [B, T]
        -> (draft logits f32 [B, T, V] predicting x_{t+2}, MTP output hidden, new cache)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP layer (mtp_num_hidden_layers == 0)")
        mask = mask.astype(bool)
        slots, meta = self._slots(cache["mtp"]["slots"], mask)
        out, block_cache = self.mtp(hidden.astype(self.dtype), self.embed_tokens(next_ids), mask, slots,
                                    cache["mtp"]["layers"][0])
        return self.head(out), out, {**cache, "mtp": {"slots": meta, "layers": [block_cache]}}



MODEL = Qwen38
