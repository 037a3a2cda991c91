"""``zoo.load``: resolve a name or path, build the model abstractly, fill it from its source.

    load(name_or_path) -> Model
      resolve   registry name -> checkpoint dir (embedded / HF download) | a local HF directory
      config    config.json -> frozen config (``zoo.config``)
      abstract  nnx.eval_shape(Model(config)): shapes and logical axes only, no parameter memory
      fill      each source tensor is read on its own (lazily), mapped to its parameter path by the
                architecture's name map, transformed to the parameter layout, checked, placed
                (with ``mesh=``: shard by shard onto its ``NamedSharding``, ``zoo.placement``)
      -> Model(module, config, tokenizer, load_info, mesh)

The public contract (DESIGN.md): ``zoo.load(name_or_path, *, quant=None, mesh=None, cache=None,
dtype="bfloat16")``; ``Model.logits(input_ids, attention_mask=None) -> np.float32 [B, S, V]``;
``Model.mtp_logits(input_ids) -> np.float32 [B, S-1, V]``; ``Model.generate`` / ``Model.stream``.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo import registry
from zoo.config import load_config
from zoo.mesh import on_mesh, resolve_mesh
from zoo.models import arch as get_arch
from zoo.models.cache_axes import shard_cache
from zoo.placement import full_index, place, source_index
from zoo.quant.fp8 import Fp8Dequantized
from zoo.quant.names import TRANSFORMS, NameMap, Target, apply_transform
from zoo.quant.safetensors import SafetensorsSource, SourceError, TensorInfo

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}
# quant= name -> "module:function" of the storage function handed to ``fill_from_source``.
QUANT_STORES = {"int8": "zoo.quant.int8:int8_store"}


def _dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def resolve(name_or_path: str | Path) -> Path:
    """A local checkpoint directory (or ``.gguf`` file) for a registry name or a path."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            return path                     # a GGUF file, or the first of a split set
        if not path.is_dir():
            raise ValueError(f"{path}: expected a checkpoint directory (config.json + *.safetensors)")
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path}: no config.json in this checkpoint directory")
        return path
    return registry.resolve_checkpoint(registry.get_spec(str(name_or_path)))


def dense_store(source, key: str, transform: str | None, want: jax.ShapeDtypeStruct, path: str):
    """Default storage: read the tensor, bring it to the parameter layout, cast to its dtype.

    A storage function decides what a parameter holds (a dense array here; ``QArray`` planes or
    int8 + scales in the quantized recipes). Its result must have ``.shape == want.shape``.
    """
    array = TRANSFORMS[transform](source.read(key))
    if array.shape != want.shape:
        raise SourceError(f"tensor {key!r} has shape {tuple(source.info(key).shape)}; parameter "
                          f"{path} needs {want.shape} (after layout transform {transform!r})")
    return jnp.asarray(array.astype(want.dtype))


class StackedSlices:
    """A one-tensor source view: the source tensors ``keys[i]`` (each through ``target.transform``)
    stacked along a new first axis, for a parameter filled slice by slice (a ``Rule`` with ``index``).
    Its only key is ``name`` (the slices' name with ``*`` for the index)."""

    def __init__(self, source, keys: list[str], target: Target, want: jax.ShapeDtypeStruct):
        self.source, self.slice_keys, self.target, self.want = source, keys, target, want
        self.name = target.sibling(keys[0], "*")

    def keys(self) -> list[str]:
        return [self.name]

    def info(self, key: str) -> TensorInfo:
        return TensorInfo(self.source.info(self.slice_keys[0]).dtype, tuple(self.want.shape))

    def read(self, key: str, index=()) -> np.ndarray:
        """``stacked[index]``; for slices of a float source through a re-indexing transform, only the
        selected slices' selected parts are read."""
        index = full_index(index, len(self.want.shape))
        if not all(isinstance(i, slice) for i in index):
            return self._read_part(range(len(self.slice_keys)), ())[index]
        return self._read_part(range(len(self.slice_keys))[index[0]], index[1:])

    def _read_part(self, picks: range, inner: tuple) -> np.ndarray:
        shape = tuple(self.want.shape[1:])
        inner = full_index(inner, len(shape))
        stacked = None
        for n, i in enumerate(picks):
            k = self.slice_keys[i]
            info = self.source.info(k)
            axes = None if getattr(info, "quantized", False) else source_index(
                self.target.transform, tuple(range(len(shape))))
            if axes is not None and tuple(shape[a] for a in axes) == tuple(info.shape):
                part = apply_transform(self.target.transform, self.source.read(k, tuple(inner[a] for a in axes)))
            else:
                part = apply_transform(self.target.transform, self.source.read(k))
                if part.shape != shape:
                    raise SourceError(f"tensor {k!r} has shape {tuple(info.shape)}; slice {i} of parameter "
                                      f"{self.target.path} needs {shape} (after layout transform "
                                      f"{self.target.transform!r})")
                part = part[inner]
            if stacked is None:
                stacked = np.empty((len(picks),) + part.shape, part.dtype)
            stacked[n] = part
        return stacked


def _stacked_view(source, slices: dict[int, str], target: Target, want) -> StackedSlices:
    """Check that ``slices`` (slice index -> source key) covers the parameter's first axis exactly."""
    n = want.shape[0]
    some_key = next(iter(slices.values()))
    extra = sorted(i for i in slices if i >= n)
    if extra:
        raise SourceError(f"tensor {slices[extra[0]]!r}: slice {extra[0]} is out of range for parameter "
                          f"{target.path} ({n} slices)")
    missing = [i for i in range(n) if i not in slices]
    if missing:
        names = ", ".join(repr(target.sibling(some_key, i)) for i in missing[:4])
        raise SourceError(f"the checkpoint has no tensor {names}"
                          f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''} "
                          f"(slice(s) {missing[:4]} of parameter {target.path})")
    return StackedSlices(source, [slices[i] for i in range(n)], target, want)


def fill_from_source(abstract: nnx.Module, source, name_map: NameMap, store=dense_store, mesh=None
                     ) -> tuple[nnx.Module, list[str]]:
    """Fill an abstract module's parameters from ``source``; returns (module, unused source keys).

    Each source tensor is read on its own and handed to ``store`` (see ``dense_store``); tensors that
    are slices of one parameter (``Rule.index``) are handed over stacked, as one ``StackedSlices``
    view. With a ``mesh``, each parameter is placed shard by shard with the sharding its logical
    axes have there (``zoo.placement``). Raises ``SourceError`` naming the tensor on a shape
    mismatch or a missing slice, and naming the parameters that no source tensor provided.
    """
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    params = {".".join(map(str, path)): var for path, var in flat}
    filled, unused = set(), []
    sliced: dict[str, tuple[Target, dict[int, str]]] = {}
    for key in source.keys():
        if name_map.ignored(key):
            continue
        hit = name_map.resolve(key)
        if hit is None or hit.path not in params:
            unused.append(key)
            continue
        if hit.index is not None:
            sliced.setdefault(hit.path, (hit, {}))[1][hit.index] = key
            continue
        _fill(params[hit.path], store, source, key, hit.transform, hit.path, mesh)
        filled.add(hit.path)
    for path, (target, slices) in sliced.items():
        view = _stacked_view(source, slices, target, params[path].get_value())
        _fill(params[path], store, view, view.name, None, path, mesh)
        filled.add(path)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise SourceError(f"the checkpoint has no tensor for parameter(s): {shown}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), unused


def _fill(var, store, source, key: str, transform, path: str, mesh=None) -> None:
    """Store source tensor ``key`` into the parameter ``var`` (at ``path``), on ``mesh`` if given."""
    if mesh is None:
        value = store(source, key, transform, var.get_value(), path)
    else:
        value = place(store, source, key, transform, var.get_value(), var.get_metadata()["axes"], path, mesh)
    if tuple(value.shape) != tuple(var.get_value().shape):
        raise SourceError(f"tensor {key!r}: stored shape {tuple(value.shape)} != parameter {path} "
                          f"shape {var.get_value().shape}")
    var.set_value(value)


def _store_for(quant: str | None, gguf: bool = False, dtype: str = "bfloat16"):
    """The storage function for a ``quant=`` name: ``QUANT_STORES``, else a recipe of
    ``zoo.quant.recipes`` (for None: ``dense_store``, or a GGUF's tensors as stored)."""
    if quant in QUANT_STORES:
        module, name = QUANT_STORES[quant].split(":")
        return getattr(importlib.import_module(module), name)
    if quant is None and not gguf:
        return dense_store
    from zoo.quant.recipes import store_for
    return store_for(quant, dtype, also_known=tuple(QUANT_STORES), gguf=gguf)


def _has_mtp_tensors(source, name_map: NameMap) -> bool:
    """Some source tensor maps to an MTP parameter (``mtp.*``)."""
    return any((hit := name_map.resolve(k)) is not None and hit.path.startswith("mtp.") for k in source.keys())


def _request_fingerprint(name_or_path, quant, dtype: str) -> dict:
    """The cache fingerprint of a load request; source identities where the sources are local."""
    from zoo import checkpoint
    path = Path(name_or_path).expanduser()
    if path.exists():
        return checkpoint.fingerprint(f"path:{path.resolve().name}", quant, dtype,
                                      [checkpoint.file_identity(f) for f in checkpoint.source_files(path)])
    spec = registry.get_spec(str(name_or_path))
    local = registry.local_checkpoint(spec)
    sources = None if local is None else [checkpoint.file_identity(f) for f in checkpoint.source_files(local)]
    return checkpoint.fingerprint(spec.name, quant, dtype, sources)


def _load_cached(name_or_path, quant, mesh, cache, dtype: str) -> "Model | None":
    """Restore from a matching cache entry under ``cache`` or the search roots (None if none)."""
    from zoo import checkpoint
    t0 = time.perf_counter()
    fp = _request_fingerprint(name_or_path, quant, dtype)
    entry, reasons = checkpoint.find(fp, checkpoint.search_roots(cache))
    for why in reasons:
        print(f"[zoo] not using cache {why}; rebuilding", file=sys.stderr)
    if entry is None:
        return None
    t_find = time.perf_counter()
    try:
        module, cfg, tokenizer = checkpoint.restore(entry, mesh)
    except checkpoint.CacheError as e:
        print(f"[zoo] not using cache: {e}; rebuilding", file=sys.stderr)
        return None
    info = {"source": "cache", "cache_path": str(entry), "dtype": dtype, "quant": quant,
            "mesh": None if mesh is None else dict(mesh.shape), "unused_tensors": [],
            "seconds": {"find": t_find - t0, "restore": time.perf_counter() - t_find,
                        "total": time.perf_counter() - t0}}
    return Model(module, cfg, tokenizer, info, mesh=mesh)


def load(name_or_path: str | Path, *, quant: str | None = None, mesh=None, cache=None,
         dtype="bfloat16") -> "Model":
    """Load a model by registry name, local HF checkpoint directory or GGUF file (see module doc).

    ``cache``: a directory for the repacked-weight cache (``zoo.checkpoint``): a matching entry there
    (or under the search roots, e.g. /kaggle/input) is restored; otherwise the model is loaded from
    its sources and, with ``cache`` given, saved there.
    """
    dtype_name = jnp.dtype(_dtype(dtype)).name
    mesh = resolve_mesh(mesh)
    cached = _load_cached(name_or_path, quant, mesh, cache, dtype_name)
    if cached is not None:
        return cached
    store = _store_for(quant, gguf=str(name_or_path).endswith(".gguf"), dtype=dtype_name)
    t0 = time.perf_counter()
    dt = _dtype(dtype)
    ckpt = resolve(name_or_path)
    t_resolve = time.perf_counter()
    if ckpt.suffix == ".gguf":
        from zoo.quant.gguf_model import open_gguf
        source, cfg, name_map, tokenizer = open_gguf(ckpt)   # config, names, vocab: from the file
        arch = get_arch(cfg.arch)
    else:
        cfg = load_config(ckpt)
        source = Fp8Dequantized(SafetensorsSource(ckpt))
        arch = get_arch(cfg.arch)
        if hasattr(cfg, "mtp_num_hidden_layers") and not cfg.mtp_num_hidden_layers and _has_mtp_tensors(
                source, arch.hf_name_map(cfg)):
            cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=1)   # MTP weights present, config silent
        name_map = arch.hf_name_map(cfg)
        from zoo.serving.tokenizer import Tokenizer
        tokenizer = Tokenizer.from_dir(ckpt)
    from zoo.quant.recipes import sources_for
    source, name_map = sources_for(quant, ckpt, cfg, source, name_map)   # recipes that mix in a GGUF
    abstract = nnx.eval_shape(lambda: arch.model_class()(cfg, dtype=dt))
    module, unused = fill_from_source(abstract, source, name_map, store, mesh=mesh)
    t_fill = time.perf_counter()
    info = {"source": "source", "format": "gguf" if ckpt.suffix == ".gguf" else "safetensors",
            "path": str(ckpt), "dtype": dtype_name, "quant": quant,
            "mesh": None if mesh is None else dict(mesh.shape), "unused_tensors": unused,
            "seconds": {"resolve": t_resolve - t0, "fill": t_fill - t_resolve}}
    model = Model(module, cfg, tokenizer, info, mesh=mesh)
    if cache is not None:
        from zoo import checkpoint
        fp = _request_fingerprint(name_or_path, quant, dtype_name)
        name = registry.REGISTRY[name_or_path].name if name_or_path in registry.REGISTRY else Path(ckpt).stem
        info["cache_path"] = str(checkpoint.save(model, cache, fp, name))
        info["seconds"]["save"] = time.perf_counter() - t_fill
    info["seconds"]["total"] = time.perf_counter() - t0
    return model


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
    ``.mesh`` (None on one device): its programs are traced on that mesh (``zoo.mesh.on_mesh``)."""

    def __init__(self, module: nnx.Module, config, tokenizer, load_info: dict, mesh=None):
        self.module = module
        self.mesh = mesh
        self.config = config
        self.tokenizer = tokenizer
        self.load_info = load_info
        self._graphdef, self._state = nnx.split(module)
        self._logits_fn = on_mesh(jax.jit(functools.partial(_full_forward, self._graphdef)), mesh)
        self._mtp_fn = on_mesh(jax.jit(functools.partial(_mtp_forward, self._graphdef)), mesh)
        self._generators = {}

    @staticmethod
    def _inputs(input_ids, attention_mask):
        ids = np.asarray(input_ids)
        if ids.ndim == 1:
            ids = ids[None]
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"input_ids must be [B, S] with S >= 1, got shape {ids.shape}")
        mask = np.ones(ids.shape, bool) if attention_mask is None else np.asarray(attention_mask).astype(bool)
        if mask.shape != ids.shape:
            raise ValueError(f"attention_mask shape {mask.shape} != input_ids shape {ids.shape}")
        return jnp.asarray(ids, jnp.int32), jnp.asarray(mask)

    def logits(self, input_ids, attention_mask=None) -> np.ndarray:
        """Full forward, no cache: float32 logits [B, S, V] (``attention_mask`` 0 = left padding)."""
        ids, mask = self._inputs(input_ids, attention_mask)
        return np.asarray(self._logits_fn(self._state, ids, mask)[0], dtype=np.float32)

    def hidden_states(self, input_ids, attention_mask=None) -> np.ndarray:
        """The final (post-norm) hidden states [B, S, D] as float32."""
        ids, mask = self._inputs(input_ids, attention_mask)
        return np.asarray(self._logits_fn(self._state, ids, mask)[1], dtype=np.float32)

    def mtp_logits(self, input_ids, attention_mask=None) -> np.ndarray:
        """MTP draft logits [B, S-1, V]: row t = MTP(h_t, embed(x_{t+1})), predicting x_{t+2}."""
        if getattr(self.module, "mtp", None) is None:
            raise ValueError("this model was loaded without an MTP layer")
        ids, mask = self._inputs(input_ids, attention_mask)
        if ids.shape[1] < 2:
            raise ValueError("mtp_logits needs at least 2 tokens per row")
        return np.asarray(self._mtp_fn(self._state, ids, mask), dtype=np.float32)

    def generator(self, spec_tokens: int = 0):
        """The continuous-batching ``Generator`` for this model (one per draft length)."""
        if spec_tokens not in self._generators:
            from zoo.serving.engine import Generator
            self._generators[spec_tokens] = Generator(self, spec_tokens=spec_tokens)
        return self._generators[spec_tokens]

    def generate(self, input_ids, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop=None, spec_tokens: int = 0):
        """Generate for each prompt in ``input_ids`` (a list of token lists) -> list[Generation].

        ``stop``: token ids and/or strings; ``spec_tokens`` k > 0 drafts k tokens per step with the
        model's MTP head (output identical to plain decoding at temperature 0)."""
        return self.generator(spec_tokens).generate(
            input_ids, max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p, top_k=top_k,
            seed=seed, stop=stop)

    def stream(self, input_ids, *, spec_tokens: int = 0, **kwargs):
        """Iterator over the generated token ids of one prompt (a list of ints)."""
        return self.generator(spec_tokens).stream(input_ids, **kwargs)
