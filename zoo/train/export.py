"""Trained weights back to an HF-layout checkpoint directory that ``zoo.load`` reads.

    export_hf(module, template, out_dir, dtype=None) -> {"path", "written", "copied"}

``template`` is the safetensors checkpoint the model was loaded from (a directory or a registry name,
e.g. ``"qwen38-tiny"``). Every tensor of it is written again under its own name and shape, from the
parameter the loader filled it into: the architecture's name map (``zoo.models.<arch>.weights``)
run backwards. For each stored name the loader's rule gives ``(parameter path, transform, slice)``;
the parameter (or its slice ``index``, for experts stored one tensor each) goes through the inverse
of the transform::

    None / "minus_one" / "a_log_from_ssm_a"   as is / w + 1 / -exp(w)
    "matmul", "transposed"                    [*, in, out] -> [*, out, in]
    "conv"                                    [K, C] -> the stored [C, 1, K] (or [C, K])
    a HeadOrder                               the stored head order put back

Tensors the loader does not map (ignored ones, e.g. a vision tower) are copied unchanged. Every
other file of the template (``config.json``, the tokenizer) is copied; ``model.safetensors`` is one
file. ``dtype``: the stored dtype (default: each parameter's own, float32 after training; e.g.
``"bfloat16"`` to match a bf16 checkpoint's size, at bf16's precision). A parameter that no stored
tensor fills is an error: the reloaded model would lack it.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from zoo.models.architectures import architecture
from zoo.models.config import load_config
from zoo.sources.names import Transform
from zoo.sources.safetensors import SafetensorsSource

WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json", "*.gguf", "*.bin", "*.pt", "*.pth")

_INVERSE = {
    None: lambda w, shape: w,
    "matmul": lambda w, shape: np.swapaxes(w, -1, -2),
    "transposed": lambda w, shape: np.swapaxes(w, -1, -2),
    "conv": lambda w, shape: w.T.reshape(shape),
    "minus_one": lambda w, shape: w + np.float32(1),
    "a_log_from_ssm_a": lambda w, shape: -np.exp(w),
}


def stored_tensor(value: np.ndarray, transform, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of a name-map rule's ``transform``: a parameter value (or slice) -> the stored
    tensor of ``shape`` it was loaded from."""
    layout = transform.layout if isinstance(transform, Transform) else transform
    if layout not in _INVERSE:
        raise NotImplementedError(f"no inverse for the layout transform {layout!r}")
    w = _INVERSE[layout](np.asarray(value), tuple(shape))
    heads = transform.heads if isinstance(transform, Transform) else None
    if heads is not None:                   # loaded as stored.take(index): put the stored order back
        w = np.take(w, np.argsort(heads.index(w.shape[heads.axis])), axis=heads.axis)
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"a parameter of shape {np.shape(value)} gives {w.shape}, the checkpoint stores {shape}")
    return np.ascontiguousarray(w)


def _template_dir(template) -> Path:
    """The template checkpoint: a directory, or a registry name (its embedded or cached checkpoint)."""
    from zoo import registry
    path = Path(template).expanduser()
    if not path.exists():
        path = registry.resolve_checkpoint(registry.get_spec(str(template)))
    if not path.is_dir() or not (path / "config.json").is_file():
        raise ValueError(f"{path}: the template must be an HF safetensors checkpoint directory")
    return path


def export_hf(module: nnx.Module, template, out_dir, dtype=None) -> dict:
    """Write ``module``'s parameters as ``out_dir/model.safetensors`` in ``template``'s names and
    layout, plus the template's other files (see the module docstring). Returns ``{"path": out_dir,
    "written": [names from parameters], "copied": [names copied from the template]}``."""
    src_dir, out = _template_dir(template), Path(out_dir)
    cfg = load_config(src_dir)
    name_map = architecture(cfg.arch).hf_name_map(cfg)
    if name_map.joins:
        raise NotImplementedError("the name map joins tensors; exporting a joined tensor is not supported")
    params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    source = SafetensorsSource(src_dir)
    out_dtype = None if dtype is None else np.dtype(ml_dtypes.bfloat16 if str(dtype) == "bfloat16" else dtype)
    tensors, written, copied, used = {}, [], [], set()
    for key in source.keys():
        target = name_map.resolve(key)
        if target is None or target.path not in params:
            if target is not None and not target.path.startswith("mtp."):
                raise ValueError(f"{key} maps to {target.path}, which the model does not have")
            tensors[key] = source.read(key)                 # ignored / unmapped / an MTP layer dropped
            copied.append(key)
            continue
        value = params[target.path]
        if not isinstance(value, (jax.Array, np.ndarray)):
            raise TypeError(f"{target.path} is stored as {type(value).__name__}; export needs dense parameters")
        value = np.asarray(value)
        if target.index is not None:
            value = value[target.index]
        w = stored_tensor(value, target.transform, source.info(key).shape)
        tensors[key] = w.astype(out_dtype or w.dtype)
        written.append(key)
        used.add(target.path)
    missing = sorted(set(params) - used)
    if missing:
        raise ValueError(f"{len(missing)} parameters have no tensor in {src_dir}: {missing[:5]}")
    out.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.is_file() and not any(f.match(p) for p in WEIGHT_FILES):
            shutil.copy2(f, out / f.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    return {"path": out, "written": written, "copied": copied}
