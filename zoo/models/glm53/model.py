"""GLM-5.3-Flash (HF ``glm5_next`` text model) assembled from the parts in ``zoo.models``.

    ids [B, T] -> embed -> copied into N = hc_mult streams X [B, T, N, D]
      -> L x DecoderLayer -> mean over the streams -> final RMSNorm -> lm_head -> logits [B, T, V]
    DecoderLayer (two hyper-connected sub-blocks, ``zoo.models.glm53.hyper``):
      X = attn_hc(X, h -> mixer(input_layernorm(h)))
      X = ffn_hc(X, h -> mlp(post_attention_layernorm(h)))
    mixer: KimiDeltaAttention ("linear_attention") or MultiLatentAttention ("indexed_attention", whose
           indexer is "full", or "shared": it reuses the token selection of the last full layer)
    mlp:   clamped SwiGLU ("dense") or MoE ("sparse")

MTP (``layers.{num_hidden_layers}`` on disk): ``zoo.models.shared.mtp.MTPHead`` around one MLA (full indexer)
+ MoE block with plain residuals (no hyper-connections), sharing the embedding and the lm_head.

One code path serves a full forward (a fresh cache as long as the input), prefill, one-token decode
and k-token verify; the cache is an explicit pytree::

    cache = {"slots": {"index", "pos", "key_pos"},            shared MLA bookkeeping (``mla.Positions``)
             "layers": [ {"conv", "state"} | {"latent"(, "indexer")} ],  one entry per layer
             "mtp": {"slots": ..., "layers": [{"latent", "indexer"}]}}   with an MTP layer

Speculative decoding: ``keep_steps`` keeps the KDA states and the indexer tails after every token of
a verify call; ``rollback`` keeps the accepted prefix. The latent cache and the pooled keys are
positional: slots past the kept prefix are marked empty and rewritten later.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.models.glm53.config import Glm53Config
from zoo.models.glm53.hyper import HyperConnection
from zoo.models.glm53.kda import KimiDeltaAttention
from zoo.models.shared.layers import Embed, Linear, RMSNorm, SwiGLU
from zoo.models.glm53.mla import (MultiLatentAttention, Positions, advance_positions, empty_positions,
                            rollback_positions)
from zoo.models.glm53.moe import MoE
from zoo.models.shared.mtp import MTPHead
from zoo.ops.matmul import matmul


def _mlp(cfg: Glm53Config, kind: str, dtype) -> nnx.Module:
    if kind == "sparse":
        return MoE(cfg, dtype=dtype)
    return SwiGLU(cfg.hidden_size, cfg.intermediate_size, dtype=dtype, limit=cfg.swiglu_limit)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: Glm53Config, index: int, *, dtype):
        self.layer_type = cfg.layer_types[index]
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, zero_centered=False)
        hc = dict(sinkhorn_iters=cfg.hc_sinkhorn_iters, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg.hc_mult, cfg.hidden_size, **hc)
        self.ffn_hc = HyperConnection(cfg.hc_mult, cfg.hidden_size, **hc)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
        if self.layer_type == "linear_attention":
            self.self_attn = KimiDeltaAttention(cfg, dtype=dtype)
        else:
            full = cfg.indexer_types[index] == "full"
            self.self_attn = MultiLatentAttention(cfg, indexer=full, dtype=dtype)
        self.mlp = _mlp(cfg, cfg.mlp_layer_types[index], dtype)

    def init_cache(self, batch: int, length: int) -> dict:
        if self.layer_type == "linear_attention":
            return self.self_attn.init_cache(batch)
        return self.self_attn.init_cache(batch, length)

    def select_step(self, cache, idx):
        return self.self_attn.select_step(cache, idx)

    def __call__(self, streams, mask, pos: Positions, cache, selection, keep_steps: bool = False):
        """streams [B, T, N, D] -> (streams, layer cache, token selection for later shared layers)."""
        def mixer(h):
            h = self.input_layernorm(h)
            if self.layer_type == "linear_attention":
                y, new_cache = self.self_attn(h, mask, cache, keep_steps)
                return y, (new_cache, selection)
            y, new_cache, new_selection = self.self_attn(h, pos, cache, selection, keep_steps)
            return y, (new_cache, new_selection)

        streams, (cache, selection) = self.attn_hc(streams, mixer)
        streams, _ = self.ffn_hc(streams, lambda h: (self.mlp(self.post_attention_layernorm(h)), None))
        return streams, cache, selection


class MTPBlock(nnx.Module):
    """The MTP layer's decoder block: MLA with its own full indexer + MoE, plain residuals."""

    def __init__(self, cfg: Glm53Config, *, dtype):
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, zero_centered=False)
        self.input_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.self_attn = MultiLatentAttention(cfg, indexer=True, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, **norm)
        self.mlp = MoE(cfg, dtype=dtype)

    def init_cache(self, batch: int, length: int) -> dict:
        return self.self_attn.init_cache(batch, length)

    def __call__(self, x, mask, pos: Positions, cache):
        """x [B, T, D] -> (x [B, T, D], block cache)."""
        h, cache, _ = self.self_attn(self.input_layernorm(x), pos, cache, None)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Glm53(nnx.Module):
    """The GLM-5.3-Flash causal LM (text part) with its optional MTP layer."""

    def __init__(self, cfg: Glm53Config, *, dtype=jnp.bfloat16):
        self.config = cfg
        self.dtype = dtype
        d = cfg.hidden_size
        norm = dict(eps=cfg.rms_norm_eps, dtype=dtype, zero_centered=False)
        self.embed_tokens = Embed(cfg.vocab_size, d, dtype=dtype)
        self.layers = nnx.List([DecoderLayer(cfg, i, dtype=dtype) for i in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(d, **norm)
        self.lm_head = None if cfg.tie_word_embeddings else Linear(
            d, cfg.vocab_size, axes=("embed", "vocab"), dtype=dtype)
        self.mtp = MTPHead(
            embed_norm=RMSNorm(d, **norm), hidden_norm=RMSNorm(d, **norm), dim=d,
            block=MTPBlock(cfg, dtype=dtype), final_norm=RMSNorm(d, **norm), dtype=dtype,
        ) if cfg.mtp_num_hidden_layers else None

    # -- caches -----------------------------------------------------------------------------
    def init_cache(self, batch: int, length: int) -> dict:
        """A zeroed cache for ``batch`` rows and ``length`` token slots."""
        cache = {"slots": empty_positions(batch, length),
                 "layers": [layer.init_cache(batch, length) for layer in self.layers]}
        if self.mtp is not None:
            cache["mtp"] = {"slots": empty_positions(batch, length),
                            "layers": [self.mtp.block.init_cache(batch, length)]}
        return cache

    # -- forward ----------------------------------------------------------------------------
    def head(self, hidden: jax.Array) -> jax.Array:
        """Post-norm hidden [B, T, D] -> float32 logits [B, T, V] (the shared output head)."""
        w = self.embed_tokens.embedding[...].T if self.lm_head is None else self.lm_head.kernel.get_value()
        axes = ("embed", "vocab") if self.lm_head is None else self.lm_head.kernel.axes   # layout on a mesh
        return matmul(hidden.astype(self.dtype), w, out_dtype=jnp.float32, axes=axes)

    def __call__(self, ids: jax.Array, mask: jax.Array, cache: dict, keep_steps: bool = False):
        """ids, mask [B, T] -> (logits f32 [B, T, V], post-norm hidden [B, T, D], new cache).

        ``keep_steps``: recurrent state is kept after every token (see ``rollback``)."""
        mask = mask.astype(bool)
        pos, meta = advance_positions(cache["slots"], mask)
        x = self.embed_tokens(ids)
        streams = jnp.broadcast_to(x[:, :, None, :], x.shape[:2] + (self.config.hc_mult, x.shape[-1]))
        selection, new_layers = None, []
        for layer, layer_cache in zip(self.layers, cache["layers"]):
            streams, layer_cache, selection = layer(streams, mask, pos, layer_cache, selection, keep_steps)
            new_layers.append(layer_cache)
        hidden = self.norm(jnp.mean(streams, axis=2))
        return self.head(hidden), hidden, {**cache, "slots": meta, "layers": new_layers}

    rollback_meta = staticmethod(rollback_positions)

    def rollback(self, cache: dict, before: dict, n_keep: jax.Array) -> dict:
        """Keep only the first ``n_keep[b]`` tokens of the last ``keep_steps`` call of each row
        (``before``: the ``cache["slots"]`` that call received)."""
        layers = [layer.select_step(c, n_keep - 1) for layer, c in zip(self.layers, cache["layers"])]
        return {**cache, "slots": rollback_positions(before, cache["slots"], n_keep), "layers": layers}

    @staticmethod
    def mtp_restore(cache: dict, mark: dict) -> dict:
        """Undo MTP calls made since ``mark`` (an earlier ``cache["mtp"]``): its bookkeeping and the
        indexer tails come back; the latent slots and pooled keys they wrote are positional."""
        block = cache["mtp"]["layers"][0]
        tails = {k: mark["layers"][0]["indexer"][k] for k in ("tail_k", "tail_gate")}
        block = {**block, "indexer": {**block["indexer"], **tails}}
        return {**cache, "mtp": {"slots": mark["slots"], "layers": [block]}}

    def mtp_forward(self, hidden: jax.Array, next_ids: jax.Array, mask: jax.Array, cache: dict):
        """MTP rows: hidden [B, T, D] (post-norm h_t), next_ids [B, T] (x_{t+1}), mask [B, T]
        -> (draft logits f32 [B, T, V] predicting x_{t+2}, MTP output hidden, new cache)."""
        if self.mtp is None:
            raise ValueError("this model has no MTP layer (mtp_num_hidden_layers == 0)")
        mask = mask.astype(bool)
        pos, meta = advance_positions(cache["mtp"]["slots"], mask)
        out, block_cache = self.mtp(hidden.astype(self.dtype), self.embed_tokens(next_ids), mask, pos,
                                    cache["mtp"]["layers"][0])
        return self.head(out), out, {**cache, "mtp": {"slots": meta, "layers": [block_cache]}}


MODEL = Glm53
