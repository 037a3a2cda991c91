"""``zoo.load``: resolve a name or path, build the model abstractly, fill it from its source.

    load(name_or_path) -> Model
      resolve   registry name -> checkpoint dir (embedded / HF download) | a local HF directory
      config    config.json -> frozen config (``zoo.config``)
      abstract  nnx.eval_shape(Model(config)): shapes and logical axes only, no parameter memory
      fill      each source tensor is read on its own (lazily), mapped to its parameter path by the
                architecture's name map, transformed to the parameter layout, checked, placed
      -> Model(module, config, tokenizer, load_info)

The public contract (DESIGN.md): ``zoo.load(name_or_path, *, quant=None, mesh=None, cache=None,
dtype="bfloat16")``; ``Model.logits(input_ids, attention_mask=None) -> np.float32 [B, S, V]``;
``Model.mtp_logits(input_ids) -> np.float32 [B, S-1, V]``; ``Model.generate`` / ``Model.stream``.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from zoo import registry
from zoo.config import load_config
from zoo.models import arch as get_arch
from zoo.quant.names import TRANSFORMS, NameMap
from zoo.quant.safetensors import SafetensorsSource, SourceError

DTYPES = {"bfloat16": jnp.bfloat16, "float32": jnp.float32, "float16": jnp.float16}


def _dtype(dtype) -> jnp.dtype:
    if isinstance(dtype, str):
        if dtype not in DTYPES:
            raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(DTYPES)}")
        return DTYPES[dtype]
    return jnp.dtype(dtype)


def resolve(name_or_path: str | Path) -> Path:
    """A local checkpoint directory for a registry name or a path."""
    path = Path(name_or_path).expanduser()
    if path.exists():
        if path.is_file() and path.suffix == ".gguf":
            raise NotImplementedError(f"{path}: GGUF loading is not implemented yet")
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


def fill_from_source(abstract: nnx.Module, source, name_map: NameMap, store=dense_store
                     ) -> tuple[nnx.Module, list[str]]:
    """Fill an abstract module's parameters from ``source``; returns (module, unused source keys).

    Each source tensor is read on its own and handed to ``store`` (see ``dense_store``). Raises
    ``SourceError`` naming the tensor on a shape mismatch, and naming the parameters that no source
    tensor provided.
    """
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    params = {".".join(map(str, path)): var for path, var in flat}
    filled, unused = set(), []
    for key in source.keys():
        if name_map.ignored(key):
            continue
        hit = name_map.lookup(key)
        if hit is None or hit[0] not in params:
            unused.append(key)
            continue
        path, transform = hit
        var = params[path]
        value = store(source, key, transform, var.get_value(), path)
        if tuple(value.shape) != tuple(var.get_value().shape):
            raise SourceError(f"tensor {key!r}: stored shape {tuple(value.shape)} != parameter {path} "
                              f"shape {var.get_value().shape}")
        var.set_value(value)
        filled.add(path)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise SourceError(f"the checkpoint has no tensor for parameter(s): {shown}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), unused


def load(name_or_path: str | Path, *, quant: str | None = None, mesh=None, cache=None,
         dtype="bfloat16") -> "Model":
    """Load a model by registry name or from a local HF checkpoint directory (see module doc)."""
    if quant is not None:
        raise NotImplementedError(f"quant={quant!r}: quantized recipes are not implemented yet")
    if mesh is not None:
        raise NotImplementedError("mesh=: sharded loading is not implemented yet")
    if cache is not None:
        raise NotImplementedError("cache=: the Orbax weight cache is not implemented yet")
    t0 = time.perf_counter()
    dt = _dtype(dtype)
    ckpt = resolve(name_or_path)
    t_resolve = time.perf_counter()
    cfg = load_config(ckpt)
    source = SafetensorsSource(ckpt)
    if hasattr(cfg, "mtp_num_hidden_layers") and not cfg.mtp_num_hidden_layers and any(
            k.startswith("mtp.") for k in source.keys()):
        cfg = dataclasses.replace(cfg, mtp_num_hidden_layers=1)   # MTP weights present, config silent
    arch = get_arch(cfg.arch)
    abstract = nnx.eval_shape(lambda: arch.model_class()(cfg, dtype=dt))
    module, unused = fill_from_source(abstract, source, arch.hf_name_map())
    t_fill = time.perf_counter()
    from zoo.serving.tokenizer import Tokenizer
    tokenizer = Tokenizer.from_dir(ckpt)
    info = {"source": "source", "path": str(ckpt), "dtype": jnp.dtype(dt).name, "unused_tensors": unused,
            "seconds": {"resolve": t_resolve - t0, "fill": t_fill - t_resolve,
                        "total": time.perf_counter() - t0}}
    return Model(module, cfg, tokenizer, info)


def _full_forward(graphdef, state, ids, mask):
    model = nnx.merge(graphdef, state)
    logits, hidden, _ = model(ids, mask, model.init_cache(ids.shape[0], ids.shape[1]))
    return logits, hidden


def _mtp_forward(graphdef, state, ids, mask):
    model = nnx.merge(graphdef, state)
    b, s = ids.shape
    _, hidden, cache = model(ids, mask, model.init_cache(b, s))
    rows_mask = mask[:, :-1] & mask[:, 1:]
    logits, _, _ = model.mtp_forward(hidden[:, :-1], ids[:, 1:], rows_mask, cache)
    return logits


class Model:
    """A loaded model: ``.module`` (NNX), ``.config``, ``.tokenizer`` (or None), ``.load_info``."""

    def __init__(self, module: nnx.Module, config, tokenizer, load_info: dict):
        self.module = module
        self.config = config
        self.tokenizer = tokenizer
        self.load_info = load_info
        self._graphdef, self._state = nnx.split(module)
        self._logits_fn = jax.jit(functools.partial(_full_forward, self._graphdef))
        self._mtp_fn = jax.jit(functools.partial(_mtp_forward, self._graphdef))
        self._generator = None

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

    @property
    def generator(self):
        if self._generator is None:
            from zoo.serving.engine import Generator
            self._generator = Generator(self)
        return self._generator

    def generate(self, input_ids, *, max_new_tokens: int, temperature: float = 0.0, top_p: float = 1.0,
                 top_k: int = 0, seed: int = 0, stop=None, spec_tokens: int = 0):
        """Generate for each prompt in ``input_ids`` (a list of token lists) -> list[Generation]."""
        return self.generator.generate(input_ids, max_new_tokens=max_new_tokens, temperature=temperature,
                                       top_p=top_p, top_k=top_k, seed=seed, stop=stop,
                                       spec_tokens=spec_tokens)

    def stream(self, input_ids, **kwargs):
        """Iterator over the generated token ids of one prompt (a list of ints)."""
        return self.generator.stream(input_ids, **kwargs)
