"""Trained weights back to stored tensors under a checkpoint's own names, by the loader's name map run
backwards: a whole HF-layout checkpoint directory that ``zoo.load`` reads, or a chosen subset of
parameters (an MTP overlay, ``zoo.train.fit_mtp``).

    export_hf(module, template, out_dir, dtype=None) -> {"path", "written", "copied"}
    export_tensors(module, name_map, select=None, template=None, dtype=None) -> {stored name: array}
    source_names(name_map, path, shape) -> [(stored name, slice index | None)]

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

A parameter no template tensor holds (or every parameter, without a template) is named by the rules
themselves (``source_names``): the first rule whose target template matches the parameter path gives
the stored name, its groups filled from the path (and the slice index), checked by resolving it
forwards; names come without the map's ``strip_prefixes`` (the loader accepts them either way).

Tensors the loader does not map (ignored ones, e.g. a vision tower) are copied unchanged. Every
other file of the template (``config.json``, the tokenizer) is copied; ``model.safetensors`` is one
file. ``dtype``: the stored dtype (default: each parameter's own, float32 after training; e.g.
``"bfloat16"`` to match a bf16 checkpoint's size, at bf16's precision). Exported parameters must be
dense arrays (a quantized one is refused, naming it).
"""

from __future__ import annotations

import fnmatch
import re
import shutil
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from zoo.models.architectures import architecture
from zoo.models.config import load_config
from zoo.sources.names import NameMap, Rule, Transform
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
_SWAPPED = ("matmul", "transposed")


def _layout(transform):
    return transform.layout if isinstance(transform, Transform) else transform


def stored_tensor(value: np.ndarray, transform, shape: tuple[int, ...]) -> np.ndarray:
    """The inverse of a name-map rule's ``transform``: a parameter value (or slice) -> the stored
    tensor of ``shape`` it was loaded from."""
    layout = _layout(transform)
    if layout not in _INVERSE:
        raise NotImplementedError(f"no inverse for the layout transform {layout!r}")
    w = _INVERSE[layout](np.asarray(value), tuple(shape))
    heads = transform.heads if isinstance(transform, Transform) else None
    if heads is not None:                   # loaded as stored.take(index): put the stored order back
        w = np.take(w, np.argsort(heads.index(w.shape[heads.axis])), axis=heads.axis)
    if tuple(w.shape) != tuple(shape):
        raise ValueError(f"a parameter of shape {np.shape(value)} gives {w.shape}, the checkpoint stores {shape}")
    return np.ascontiguousarray(w)


def stored_shape(transform, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The stored (HF numpy-order) shape of a parameter (slice) of ``shape`` under ``transform``."""
    layout, shape = _layout(transform), tuple(shape)
    if layout in _SWAPPED:
        return shape[:-2] + (shape[-1], shape[-2])
    if layout == "conv":                                     # [K, C] -> HF's [C, 1, K]
        return (shape[1], 1, shape[0])
    return shape


_GROUP_REF = re.compile(r"\\g<(\w+)>")


def _target_regex(template: str) -> re.Pattern:
    """A rule's target template (``layers.\\g<i>.mlp``) as a regex that recovers its groups from a path."""
    parts, pos = [], 0
    for m in _GROUP_REF.finditer(template):
        parts += [re.escape(template[pos:m.start()]), f"(?P<{m.group(1)}>[^.]+?)"]
        pos = m.end()
    return re.compile("".join(parts) + re.escape(template[pos:]))


def _fill_pattern(pattern: str, groups: dict[str, str]) -> str | None:
    """The one name a rule's regex matches with its named groups set to ``groups``; None when the
    regex has any other construct (a class, a repetition or an alternation outside a group)."""
    out, i = [], 0
    while i < len(pattern):
        c = pattern[i]
        if pattern.startswith("(?P<", i):
            name = pattern[i + 4:pattern.index(">", i)]
            depth, j = 0, i
            while True:                                      # to the group's closing parenthesis
                if pattern[j] == "\\":
                    j += 2
                    continue
                depth += {"(": 1, ")": -1}.get(pattern[j], 0)
                j += 1
                if depth == 0:
                    break
            if name not in groups:
                return None
            out.append(groups[name])
            i = j
        elif c == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            out.append(pattern[i + 1])
            i += 2
        elif c in "\\()[]{}|?*+^$.":
            return None
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _rule_name(name_map: NameMap, rule: Rule, path: str, index: int | None) -> str | None:
    m = _target_regex(rule.target).fullmatch(path)
    if m is None or (rule.index is None) != (index is None):
        return None
    groups = dict(m.groupdict())
    if rule.index is not None:
        groups[rule.index] = str(index)
    name = _fill_pattern(rule.pattern, groups)
    if name is None or name_map.ignored(name):
        return None
    hit = name_map.resolve(name)
    return name if hit is not None and hit.path == path and hit.index == index else None


def source_names(name_map: NameMap, path: str, shape: tuple[int, ...]) -> list[tuple[str, int | None]]:
    """The stored names of parameter ``path`` (of ``shape``) by ``name_map``'s rules run backwards:
    ``[(name, None)]``, or one ``(name, i)`` per slice along the first axis for a rule with an
    ``index`` (experts stored one tensor each). ValueError if no rule names it."""
    for rule in name_map.rules:
        if rule.index is None:
            name = _rule_name(name_map, rule, path, None)
            if name is not None:
                return [(name, None)]
        elif _rule_name(name_map, rule, path, 0) is not None:
            return [(_rule_name(name_map, rule, path, i), i) for i in range(shape[0])]
    raise ValueError(f"no rule of the name map names parameter {path}")


def _dense(path: str, value) -> np.ndarray:
    if not isinstance(value, (jax.Array, np.ndarray)):
        raise TypeError(f"{path} is stored as {type(value).__name__}; export needs dense parameters")
    return np.asarray(value)


def _out_dtype(dtype):
    return None if dtype is None else np.dtype(ml_dtypes.bfloat16 if str(dtype) == "bfloat16" else dtype)


def export_tensors(module: nnx.Module, name_map: NameMap, *, select=None, template=None, dtype=None
                   ) -> dict[str, np.ndarray]:
    """``{stored name: array}`` for ``module``'s parameters whose dotted path matches a glob of
    ``select`` (None: all), under ``template``'s names where that source (a ``WeightSource``) holds
    the parameter, else the names ``source_names`` gives (see the module docstring)."""
    globs = None if select is None else ((select,) if isinstance(select, str) else tuple(select))
    params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    params = {k: v for k, v in params.items() if globs is None or any(fnmatch.fnmatchcase(k, g) for g in globs)}
    out_dtype, tensors, named = _out_dtype(dtype), {}, set()
    for key in ([] if template is None else template.keys()):
        target = name_map.resolve(key)
        if target is not None and target.path in params:
            value = _dense(target.path, params[target.path])
            w = stored_tensor(value if target.index is None else value[target.index], target.transform,
                              template.info(key).shape)
            tensors[key] = w.astype(out_dtype or w.dtype)
            named.add(target.path)
    for path in sorted(set(params) - named):
        value = _dense(path, params[path])
        for name, index in source_names(name_map, path, value.shape):
            transform = name_map.resolve(name).transform
            part = value if index is None else value[index]
            w = stored_tensor(part, transform, stored_shape(transform, part.shape))
            tensors[name] = w.astype(out_dtype or w.dtype)
    return tensors


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
    params = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    source = SafetensorsSource(src_dir)
    tensors, copied = {}, []
    for key in source.keys():
        target = name_map.resolve(key)
        if target is None or target.path not in params:
            if target is not None and not target.path.startswith("mtp."):
                raise ValueError(f"{key} maps to {target.path}, which the model does not have")
            tensors[key] = source.read(key)                 # ignored / unmapped / an MTP layer dropped
            copied.append(key)
    written = export_tensors(module, name_map, template=source, dtype=dtype)
    tensors.update(written)
    out.mkdir(parents=True, exist_ok=True)
    for f in src_dir.iterdir():
        if f.is_file() and not any(f.match(p) for p in WEIGHT_FILES):
            shutil.copy2(f, out / f.name)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "model.safetensors").chmod(0o644)                # safetensors writes it 0600, unlike its neighbours
    return {"path": out, "written": list(written), "copied": copied}
