"""``zoo.load``: resolve a name or path, build the model abstractly, fill it from its source.

    load(name_or_path) -> Model
      resolve   registry name -> checkpoint dir (embedded / HF download) | a local HF directory
      config    config.json -> frozen config (``zoo.models.config``)
      abstract  nnx.eval_shape(Model(config)): shapes and logical axes only, no parameter memory
      fill      each source tensor is read on its own (lazily), mapped to its parameter path by the
                architecture's name map, transformed to the parameter layout, checked, placed
                (with ``mesh=``: shard by shard onto its ``NamedSharding``, ``zoo.sharding.placement``)
      -> Model(module, config, tokenizer, load_info, mesh)

The public contract (docs/architecture.md): ``zoo.load(name_or_path, *, quant=None, mesh=None, cache=None,
dtype="bfloat16", mtp=None)``; ``Model.logits(input_ids, attention_mask=None) -> np.float32 [B, S, V]``;
``Model.mtp_logits(input_ids) -> np.float32 [B, S-1, V]``; ``Model.generate`` / ``Model.stream``.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo.engine.generator import Generator
from zoo.engine.step_programs import shared
from zoo.loader.abstract import abstract_load
from zoo.loader.fill import fill_from_source
from zoo.loader.open import check_recipe, dtype_of, open_checkpoint, resolve
from zoo.loader.overlay import apply_overlay, read_overlay
from zoo.models.architectures import architecture
from zoo.sharding.cache_axes import shard_cache
from zoo.sharding.mesh import host_value, on_mesh, resolve_mesh
from zoo.weight_cache import store as weight_cache


def _load_cached(name_or_path, quant, mesh, cache, dtype: str, vision: bool = True, mmproj=None) -> "Model | None":
    """Restore from a matching cache entry under ``cache`` or the search roots (None if none)."""
    t0 = time.perf_counter()
    fp = weight_cache.request_fingerprint(name_or_path, quant, dtype, vision, mmproj)
    entry, reasons = weight_cache.find(fp, weight_cache.search_roots(cache))
    for why in reasons:
        print(f"[zoo] not using cache {why}; rebuilding", file=sys.stderr)
    if entry is None:
        return None
    t_find = time.perf_counter()
    try:
        module, cfg, tokenizer = weight_cache.restore(entry, mesh)
    except weight_cache.CacheError as e:
        print(f"[zoo] not using cache: {e}; rebuilding", file=sys.stderr)
        return None
    info = {"source": "cache", "cache_path": str(entry), "dtype": dtype, "quant": quant,
            "mesh": None if mesh is None else dict(mesh.shape), "unused_tensors": [],
            "seconds": {"find": t_find - t0, "restore": time.perf_counter() - t_find,
                        "total": time.perf_counter() - t0}}
    return Model(module, cfg, tokenizer, info, mesh=mesh)


def _load_abstract(name_or_path, quant: str | None, mesh, dtype: str, vision: bool = True) -> "Model":
    """``load(..., weights=False)``: the model with abstract parameters of their stored kinds, placed
    on ``mesh`` (``zoo.loader.abstract.abstract_load``)."""
    module, cfg = abstract_load(name_or_path, quant, dtype_of(dtype), mesh, vision)
    info = {"source": "abstract", "dtype": dtype, "quant": quant, "mesh": None if mesh is None else dict(mesh.shape),
            "unused_tensors": []}
    return Model(module, cfg, None, info, mesh=mesh)


def load(name_or_path: str | Path, *, quant: str | None = None, mesh=None, cache=None,
         dtype="bfloat16", weights: bool = True, mtp=None, vision: bool = True, mmproj=None) -> "Model":
    """Load a model by registry name, local HF checkpoint directory or GGUF file (see module doc).

    ``quant``: a recipe of the model's architecture (``zoo.models.recipe_lookup.recipes_for``), or None
    (the source as stored). ``cache``: a directory for the repacked-weight cache
    (``zoo.weight_cache``): a matching entry there (or under the search roots, e.g. /kaggle/input)
    is restored; otherwise the model is loaded from its sources and, with ``cache`` given, saved there.
    ``weights=False``: the abstract model (no weight file read, nothing allocated; ``_load_abstract``),
    for lowering and compiling the model's programs for a target (``zoo.tools.compile``).
    ``mtp``: an MTP overlay directory (``zoo fit-mtp``; ``zoo.loader.overlay``): checked before the
    model loads, applied after (its MTP parameters replace the checkpoint's, or add an MTP layer);
    ``load_info["mtp_overlay"]`` describes it. The cache, if any, holds the model without it.
    ``vision=False``: a multimodal checkpoint's vision tower is left out (not read, not placed; the
    model takes text only); a cache entry records which (its fingerprint's ``vision``). ``mmproj``: a
    llama.cpp multimodal projector GGUF holding the tower of a model loaded from a GGUF
    (``zoo.loader.mmproj``; without it, the only ``mmproj*.gguf`` beside the GGUF is used).
    """
    dtype_name = jnp.dtype(dtype_of(dtype)).name
    mesh = resolve_mesh(mesh)
    if not weights:
        if mtp is not None:
            raise ValueError("an MTP overlay (mtp=) applies to loaded weights, not to weights=False")
        return _load_abstract(name_or_path, quant, mesh, dtype_name, vision)
    overlay = None if mtp is None else read_overlay(mtp)     # a missing or corrupt overlay fails first
    model = _load_weights(name_or_path, quant, mesh, cache, dtype_name, vision, mmproj)
    if overlay is None:
        return model
    module, cfg, info = apply_overlay(model.module, model.config, overlay, mesh, model.load_info.get("path"))
    return Model(module, cfg, model.tokenizer, {**model.load_info, "mtp_overlay": info}, mesh=mesh)


def _load_weights(name_or_path, quant: str | None, mesh, cache, dtype_name: str, vision: bool = True,
                  mmproj=None) -> "Model":
    """``load`` with weights: from a cache entry, else from the sources (saved to ``cache`` if given)."""
    check_recipe(name_or_path, quant)
    cached = _load_cached(name_or_path, quant, mesh, cache, dtype_name, vision, mmproj)
    if cached is not None:
        return cached
    t0 = time.perf_counter()
    ckpt = resolve(name_or_path)
    t_resolve = time.perf_counter()
    source, cfg, name_map, tokenizer, store, fmt = open_checkpoint(ckpt, quant, dtype_name, vision, mmproj)
    model_class = architecture(cfg.arch).model_class()
    abstract = nnx.eval_shape(lambda: model_class(cfg, dtype=dtype_name))
    module, unused = fill_from_source(abstract, source, name_map, store, mesh=mesh)
    t_fill = time.perf_counter()
    info = {"source": "source", "format": fmt, "path": str(ckpt), "dtype": dtype_name, "quant": quant,
            "mesh": None if mesh is None else dict(mesh.shape), "unused_tensors": unused,
            "seconds": {"resolve": t_resolve - t0, "fill": t_fill - t_resolve}}
    model = Model(module, cfg, tokenizer, info, mesh=mesh)
    if cache is not None:
        fp = weight_cache.request_fingerprint(name_or_path, quant, dtype_name, vision, mmproj)
        info["cache_path"] = str(weight_cache.save(model, cache, fp, weight_cache.entry_name(name_or_path, ckpt)))
        info["seconds"]["save"] = time.perf_counter() - t_fill
    info["seconds"]["total"] = time.perf_counter() - t0
    return model


def padded_length(s: int) -> int:
    """The length a full forward of ``s`` tokens runs at: ``s`` rounded up to a multiple of an eighth
    of the power of two at or below it, at least 16 (at most 8 programs per doubling of the length,
    at most 1/8 of the positions padding): 1..16 -> 16, 100 -> 112, 1100 -> 1152."""
    granule = max(16, (1 << (max(s, 1).bit_length() - 1)) // 8)
    return -(-s // granule) * granule


def _full_forward(graphdef, state, ids, mask):
    model = nnx.merge(graphdef, state)
    logits, hidden, _ = model(ids, mask, shard_cache(model.init_cache(ids.shape[0], ids.shape[1])))
    return logits, hidden


def _mtp_forward(graphdef, state, ids, mask):
    model = nnx.merge(graphdef, state)
    b, s = ids.shape
    _, hidden, cache = model(ids, mask, shard_cache(model.init_cache(b, s)))
    rows_mask = mask[:, :-1] & mask[:, 1:]
    logits, _, _ = model.mtp_forward(hidden[:, :-1], ids[:, 1:], rows_mask, cache)
    return logits


class Model:
    """A loaded model: ``.module`` (NNX), ``.config``, ``.tokenizer`` (or None), ``.load_info``, and
    ``.mesh`` (None on one device): its programs are traced on that mesh (``zoo.sharding.mesh.on_mesh``)."""

    def __init__(self, module: nnx.Module, config, tokenizer, load_info: dict, mesh=None):
        self.module = module
        self.mesh = mesh
        self.config = config
        self.tokenizer = tokenizer
        self.load_info = load_info
        self._graphdef, self._state = nnx.split(module)
        g = self._graphdef            # one jitted copy per equal model in the process (``step_programs.shared``)
        logits = shared(("full forward", g, mesh), lambda: jax.jit(functools.partial(_full_forward, g)))
        self._logits_fn = on_mesh(logits, mesh)
        mtp = shared(("mtp forward", g, mesh), lambda: jax.jit(functools.partial(_mtp_forward, g)))
        self._mtp_fn = on_mesh(mtp, mesh)
        self._generators = {}

    @staticmethod
    def _inputs(input_ids, attention_mask):
        """(ids int32 [B, P], mask bool [B, P], S): the rows right-padded with masked tokens to
        ``padded_length(S)``, so that lengths within a bucket share one compiled program; every model
        here is causal, so a position's outputs do not depend on the padding after it."""
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, S] with S >= 1, got shape {ids.shape}")
        mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
        s = ids.shape[1]
        pad = ((0, 0), (0, padded_length(s) - s))
        return jnp.asarray(np.pad(ids, pad), jnp.int32), jnp.asarray(np.pad(mask, pad)), s

    def logits(self, input_ids, attention_mask=None) -> np.ndarray:
        """Full forward, no cache: float32 logits [B, S, V] (``attention_mask`` 0 = left padding)."""
        ids, mask, s = self._inputs(input_ids, attention_mask)
        return host_value(self._logits_fn(self._state, ids, mask)[0])[:, :s].astype(np.float32)

    def hidden_states(self, input_ids, attention_mask=None) -> np.ndarray:
        """The final (post-norm) hidden states [B, S, D] as float32."""
        ids, mask, s = self._inputs(input_ids, attention_mask)
        return host_value(self._logits_fn(self._state, ids, mask)[1])[:, :s].astype(np.float32)

    def mtp_logits(self, input_ids, attention_mask=None) -> np.ndarray:
        """MTP draft logits [B, S-1, V]: row t = MTP(h_t, embed(x_{t+1})), predicting x_{t+2}."""
        if getattr(self.module, "mtp", None) is None:
            raise ValueError("this model was loaded without an MTP layer")
        ids, mask, s = self._inputs(input_ids, attention_mask)
        if s < 2:
            raise ValueError("mtp_logits needs at least 2 tokens per row")
        return host_value(self._mtp_fn(self._state, ids, mask))[:, :s - 1].astype(np.float32)

    def generator(self, spec_tokens: int = 0, spec_policy: str = "auto"):
        """The continuous-batching ``Generator`` for this model (one per draft length and speculation
        policy: "auto" chooses each step's drafts, ``zoo.engine.spec_policy``; "fixed" drafts
        ``spec_tokens`` every step)."""
        key = (spec_tokens, spec_policy if spec_tokens else None)
        if key not in self._generators:
            self._generators[key] = Generator(self, spec_tokens=spec_tokens, spec_policy=spec_policy)
        return self._generators[key]

    def generate(self, input_ids, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop=None, spec_tokens: int = 0, spec_policy: str = "auto",
                 logprobs: int | None = None, prompt_logprobs: int | None = None, images=None):
        """Generate for each prompt in ``input_ids`` (a list of token lists) -> list[Generation].

        ``stop``: token ids and/or strings (a stop string ends the output right before it:
        ``Generation.tokens`` end before the token in which it starts, ``Generation.text`` keeps the
        characters of that token before it); ``spec_tokens`` k > 0 drafts k tokens per step with the
        model's MTP head at most (``spec_policy``: ``generator``'s; the output is plain decoding's,
        sampled tokens included). ``logprobs`` /
        ``prompt_logprobs`` N: ``Generation.logprobs`` / ``.prompt_logprobs``, a ``TokenLogprob``
        per generated / prompt token with N alternatives (``max_new_tokens`` 0: the prompt's only).
        ``images``: per prompt, its ``zoo.engine.request.ImageInput``s in order (each fills its run of
        ``config.image_token_id`` placeholders; ``zoo.engine.image_prefill``)."""
        gen = self.generator(spec_tokens, spec_policy)
        kw = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                  stop=stop, logprobs=logprobs, prompt_logprobs=prompt_logprobs)
        if images is None:
            return gen.generate(input_ids, **kw)
        input_ids = list(input_ids)
        if len(images) != len(input_ids):
            raise ValueError(f"{len(images)} image lists for {len(input_ids)} prompts")
        reqs = [gen.make_request(p, images=tuple(im or ()), **kw) for p, im in zip(input_ids, images)]
        for r in reqs:
            gen.check(r)                              # all refused before any is queued
        for r in reqs:
            gen.submit(r)
        while not all(r.done.is_set() for r in reqs):
            gen.step()
        return [r.result() for r in reqs]

    def stream(self, input_ids, *, spec_tokens: int = 0, spec_policy: str = "auto", **kwargs):
        """Iterator over the generated token ids of one prompt (a list of ints)."""
        return self.generator(spec_tokens, spec_policy).stream(input_ids, **kwargs)
