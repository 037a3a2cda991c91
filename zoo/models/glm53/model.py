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
and k-token verify; the cache is explicit (the model contract of ``zoo.models.contract``)::

    ModelCache(slots=PositionMeta(index, pos, key_pos),          shared MLA bookkeeping
               layers=(KDACache(conv, state) | LatentCache(latent, indexer | None), ...),  one per layer
               mtp=MTPCache(slots=PositionMeta, layers=(LatentCache,)))          with an MTP layer

Images (``zoo.models.glm53.multimodal``): with a ``vision_config`` the model has ``visual`` (the
vision tower, ``zoo.models.glm53.vision``); ``encode_images`` runs it (``image_geometry`` +
``encode_images_padded``: the same rows from one program per padded size), and ``__call__(..., mm=MMInputs)``
takes its rows in place of the placeholder tokens' embeddings (``where(is_image, rows, embed(ids))``)
before the streams are made. ``mtp_forward(..., mm=)`` does the same for the MTP layer's next-token
embeddings (transformers has no MTP layer: it drops ``layers.{N}`` on load; the rows follow what
speculative decoders of multimodal targets feed their drafters).

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
from zoo.models.glm53.mla import (
    LatentCache,
    MultiLatentAttention,
    PositionMeta,
    Positions,
    advance_positions,
    empty_positions,
    rollback_positions,
)
from zoo.models.glm53.moe import MoE
from zoo.models.glm53.multimodal import MMInputs
from zoo.models.glm53.vision import VisionTower
from zoo.models.shared.cache import ModelCache, MTPCache
from zoo.models.shared.causal_lm import CausalLM, graph_dtype
from zoo.models.shared.layers import Embed, Linear, RMSNorm, SwiGLU
from zoo.models.shared.mtp import MTPHead


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

    def init_cache(self, batch: int, length: int):
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

    def init_cache(self, batch: int, length: int) -> LatentCache:
        return self.self_attn.init_cache(batch, length)

    def restore(self, now: LatentCache, mark: LatentCache) -> LatentCache:
        """Undo the block's calls made since ``mark`` (``CausalLM.mtp_restore``)."""
        return self.self_attn.restore(now, mark)

    def __call__(self, x, mask, pos: Positions, cache):
        """x [B, T, D] -> (x [B, T, D], block cache)."""
        h, cache, _ = self.self_attn(self.input_layernorm(x), pos, cache, None)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x)), cache


class Glm53(CausalLM):
    """The GLM-5.3-Flash causal LM with its optional MTP layer and vision tower."""

    def __init__(self, cfg: Glm53Config, *, dtype=jnp.bfloat16):
        dtype = graph_dtype(dtype)
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
        self.visual = None if cfg.vision is None else VisionTower(cfg.vision, dtype=dtype)

    # -- position bookkeeping (``CausalLM``) ------------------------------------------------------
    empty_meta = staticmethod(empty_positions)
    rollback_meta = staticmethod(rollback_positions)

    def advance(self, meta: PositionMeta, mask: jax.Array) -> tuple[Positions, PositionMeta]:
        return advance_positions(meta, mask)

    # -- images -----------------------------------------------------------------------------
    def encode_images(self, patches: jax.Array, grid_thw) -> jax.Array:
        """The vision tower: patches [N, C*T*P*P], static grid ((t, h, w), ...) -> rows [N / m^2, D]."""
        if self.visual is None:
            raise ValueError("this model has no vision tower (config.json has no vision_config, or it was "
                             "loaded with vision=False)")
        return self.visual(patches, grid_thw)

    def embed(self, ids: jax.Array, mm: MMInputs | None = None) -> jax.Array:
        """Input embeddings [B, T, D]: the tokens', or the tower's rows where ``mm.is_image``."""
        x = self.embed_tokens(ids)
        if mm is None:
            return x
        return jnp.where(jnp.asarray(mm.is_image, bool)[..., None], jnp.asarray(mm.rows).astype(x.dtype), x)

    # -- forward ----------------------------------------------------------------------------
    def __call__(self, ids: jax.Array, mask: jax.Array, cache: ModelCache, keep_steps: bool = False,
                 mm: MMInputs | None = None):
        """ids, mask [B, T] -> (logits f32 [B, T, V], post-norm hidden [B, T, D], new cache).

        ``keep_steps``: recurrent state is kept after every token (see ``rollback``). ``mm``: image
        rows in place of placeholder tokens (``zoo.models.glm53.multimodal``; its positions unused)."""
        mask = mask.astype(bool)
        pos, meta = self.advance(cache.slots, mask)
        x = self.embed(ids, mm)
        streams = jnp.broadcast_to(x[:, :, None, :], x.shape[:2] + (self.config.hc_mult, x.shape[-1]))
        selection, new_layers = None, []
        for layer, layer_cache in zip(self.layers, cache.layers):
            streams, layer_cache, selection = layer(streams, mask, pos, layer_cache, selection, keep_steps)
            new_layers.append(layer_cache)
        hidden = self.norm(jnp.mean(streams, axis=2))
        return self.head(hidden), hidden, cache.replace(slots=meta, layers=tuple(new_layers))

    def mtp_forward(self, hidden: jax.Array, next_ids: jax.Array, mask: jax.Array, cache: ModelCache,
                    mm: MMInputs | None = None):
        """``CausalLM.mtp_forward``; ``mm`` (aligned with ``next_ids``: row t holds x_{t+1}'s image row)
        puts the tower's rows in place of placeholder tokens' embeddings, as the main forward does."""
        if mm is None:
            return super().mtp_forward(hidden, next_ids, mask, cache)
        if self.mtp is None:
            raise ValueError("this model has no MTP layer (mtp_num_hidden_layers == 0)")
        mask = mask.astype(bool)
        positions, meta = self.advance(cache.mtp.slots, mask)
        out, block_cache = self.mtp(hidden.astype(self.dtype), self.embed(next_ids, mm), mask, positions,
                                    cache.mtp.layers[0])
        return self.head(out), out, cache.replace(mtp=MTPCache(slots=meta, layers=(block_cache,)))


MODEL = Glm53
