"""Memory planner: bytes per tensor, per tensor class and per device, from a config and a recipe
alone (no download), or from a GGUF header.

    plan(name, quant=..., devices=8, layout="tp") -> Plan   a registry name: its preset + a recipe
    plan_config(cfg, recipe, devices) -> Plan    any config (e.g. a test-local one)
    plan_gguf(path, devices) -> Plan             a GGUF's header (local, hf:// or https://): its tensors as stored

The tensor inventory of an architecture is written in llama.cpp's GGUF names and numpy-order
shapes (matrices ``[out, in]``, expert banks ``[E, out, in]``); the tests check it against real
GGUF files. Each tensor gets a storage kind from the recipe (``zoo.quant.recipe``) and its bytes:

* a ggml type: the GGUF payload (``zoo.formats.ggml.tensor_nbytes``);
* ``"FP8"``: one byte per weight plus an f32 scale per 128x128 block (per expert for banks);
* ``"INT8"``: one byte per weight plus an f32 scale per output channel (``zoo.quant.int8``).

``kind`` and ``nbytes`` are what the recipe reads (the source's storage: file bytes). Per device
(``devices`` chips in a ``zoo.sharding.mesh`` layout, "tp" or "ep"), ``per_device_bytes`` is what
one chip holds once loaded: the abstract load (``zoo.loader.abstract``) placed on an abstract mesh,
so exactly the kinds the loader stores (FP8 read into the load dtype, float parameters in their own
dtype, QArray planes packed per device with their padding) and the splits ``zoo.load(...,
mesh=...)`` places (in "tp" the routed-expert banks split as docs/reference.md section 4 describes:
gate/up by output rows, down by input blocks; in "ep" by expert over ``ep`` and by width over
``tp``). A parameter shared by several inventory tensors (a joined ``kv_b``) is shared by element
count. ``zoo.tools.compile_report`` compiles the same abstract model for a real target; the tests check that
the compiler's argument bytes equal these.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

from zoo import registry
from zoo.formats.ggml import QType, tensor_nbytes
from zoo.loader.abstract import (
    abstract_module,
    gguf_param_kinds,
    inventory_targets,
    param_kinds,
    shard_bytes_of,
)
from zoo.loader.gguf_model import config_from_gguf
from zoo.models.architectures import architecture
from zoo.models.recipe_lookup import get_recipe
from zoo.models.shared.inventory import Tensor
from zoo.quant.recipe import Recipe
from zoo.sharding.device_plan import plan_mesh
from zoo.sources.gguf import GGUFSource

FP8_BLOCK = 128


@dataclass(frozen=True)
class TensorPlan:
    tensor: Tensor
    kind: str
    nbytes: int
    per_device_bytes: int


@dataclass(frozen=True)
class Plan:
    model: str
    recipe: str
    devices: int
    tensors: tuple[TensorPlan, ...]
    layout: str = "tp"

    @property
    def by_class(self) -> dict[str, int]:
        """Stored bytes per tensor class (``routed_experts``, ``attention``, ``mlp``, ...)."""
        out: Counter = Counter()
        for t in self.tensors:
            out[t.tensor.cls] += t.nbytes
        return dict(out)

    @property
    def by_kind(self) -> dict[str, int]:
        out: Counter = Counter()
        for t in self.tensors:
            out[t.kind] += t.nbytes
        return dict(out)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def per_device_bytes(self) -> int:
        """Bytes every device holds (planes of its expert slices + its share of the rest)."""
        return sum(t.per_device_bytes for t in self.tensors)

    def fits(self, budget_bytes: int) -> bool:
        """Whether the weights fit ``budget_bytes`` per device (caches and activations not counted)."""
        return self.per_device_bytes <= budget_bytes

    def to_dict(self, budget_bytes: int | None = None) -> dict:
        """The plan as JSON-ready data (with ``fits`` when a budget is given)."""
        out = {"model": self.model, "recipe": self.recipe, "devices": self.devices, "layout": self.layout,
               "total_bytes": self.total_bytes, "per_device_bytes": self.per_device_bytes,
               "by_class": self.by_class, "by_kind": self.by_kind,
               "tensors": [{"name": t.tensor.name, "shape": list(t.tensor.shape), "class": t.tensor.cls,
                            "kind": t.kind, "bytes": t.nbytes, "per_device_bytes": t.per_device_bytes}
                           for t in self.tensors]}
        if budget_bytes is not None:
            out.update(budget_bytes=budget_bytes, fits=self.fits(budget_bytes))
        return out

    def summary(self) -> str:
        rows = [f"{self.model} / {self.recipe} on {self.devices} device(s), layout {self.layout}"]
        rows += [f"  {cls:18s} {n / 1e9:10.3f} GB" for cls, n in sorted(self.by_class.items())]
        rows.append(f"  {'total':18s} {self.total_bytes / 1e9:10.3f} GB, "
                    f"{self.per_device_bytes / 1e9:.3f} GB per device")
        return "\n".join(rows)


# --- bytes ----------------------------------------------------------------------------------------


def _nbytes(shape: tuple[int, ...], kind: str) -> int:
    if kind == "FP8":
        *lead, rows, cols = shape
        scales = math.ceil(rows / FP8_BLOCK) * math.ceil(cols / FP8_BLOCK) * 4
        return math.prod(lead) * (rows * cols + scales)
    if kind == "INT8":                                   # int8 weights + an f32 scale per output channel
        *lead, rows, cols = shape
        return math.prod(lead) * rows * (cols + 4)
    return tensor_nbytes(QType[kind], shape)


def _mesh(devices: int, layout: str):
    if devices < 1:
        raise ValueError(f"devices must be >= 1, got {devices}")
    return plan_mesh(layout, devices)


def _param_device_bytes(cfg, kinds: dict, mesh, dtype) -> dict[str, int]:
    """``{parameter path: bytes one device holds}`` of the abstract model placed on ``mesh``."""
    module = abstract_module(cfg, kinds, jnp.dtype(dtype), mesh)
    return {".".join(map(str, path)): shard_bytes_of(var.get_value())
            for path, var in nnx.to_flat_state(nnx.state(module))}


def _shares(tensors: list, targets: list[str], device_bytes: dict[str, int]) -> list[int]:
    """Each inventory tensor's part of its parameter's per-device bytes, by element count (a joined
    or stacked parameter is shared by its tensors); parts of one parameter add up exactly."""
    numel: Counter = Counter()
    for t, path in zip(tensors, targets):
        numel[path] += math.prod(t.shape)
    left, seen, out = dict(device_bytes), Counter(), []
    for t, path in zip(tensors, targets):
        seen[path] += math.prod(t.shape)
        part = left[path] if seen[path] == numel[path] else device_bytes[path] * math.prod(t.shape) // numel[path]
        left[path] -= part
        out.append(part)
    return out


def plan_config(cfg, recipe: str | Recipe | None, devices: int = 8, model: str | None = None,
                layout: str = "tp") -> Plan:
    """The plan of ``cfg`` (a config object with ``arch``) under ``recipe`` on ``devices`` chips."""
    if recipe is None:                       # the source as stored, loaded in bfloat16 (zoo.load's default)
        recipe = "bf16"
    recipe = get_recipe(recipe, cfg.arch) if isinstance(recipe, str) else recipe
    if recipe.plan is None:
        raise ValueError(f"recipe {recipe.name!r} of {cfg.arch} is a whole GGUF whose per-tensor types are the "
                         f"file's: plan it from the file's header (zoo plan FILE.gguf, zoo.tools.plan.plan_gguf)")
    mesh = _mesh(devices, layout)
    pairs = inventory_targets(cfg)
    device_bytes = _param_device_bytes(cfg, param_kinds(cfg, recipe), mesh, recipe.dtype or "bfloat16")
    inventory = [t for t, _ in pairs]
    shares = _shares(inventory, [target.path for _, target in pairs], device_bytes)
    tensors = [TensorPlan(t, kind, _nbytes(t.shape, kind), share)
               for t, share, kind in zip(inventory, shares, (recipe.kind_of(t) for t in inventory))]
    return Plan(model or cfg.arch, recipe.name, devices, tuple(tensors), layout)


def plan_gguf(path, devices: int = 8, quant: str | None = None, layout: str = "tp") -> Plan:
    """The plan of a GGUF file (or split set) from its header alone: every tensor as stored (its own
    ggml type and bytes; ``quant=None``), or the file's model under a recipe. Classes come from the
    architecture's inventory; a tensor it does not list is class ``"other"`` and a tensor the model
    does not load (the MTP block's copies of the embedding and head) is counted whole."""
    src = GGUFSource(path)
    cfg = config_from_gguf(src)
    name = Path(src.files[0]).name
    if quant is not None:
        return plan_config(cfg, quant, devices, name, layout)
    mesh = _mesh(devices, layout)
    names = architecture(cfg.arch).gguf_name_map(cfg)
    device_bytes = _param_device_bytes(cfg, gguf_param_kinds(src, names), mesh, "bfloat16")
    known = {t.name: t for t in architecture(cfg.arch).part("inventory")(cfg)}
    joined = names.joined_names(src.keys())
    listed, targets = [], []
    for key in src.keys():
        info = src.info(key)
        t = known.get(key) or Tensor(key, info.shape, "other", len(info.shape) >= 2)
        listed.append((t, info))
        target = names.resolve(joined.get(key, key))
        targets.append(target.path if target is not None and target.path in device_bytes else None)
    loaded = [(t, path) for (t, _), path in zip(listed, targets) if path is not None]
    shares = iter(_shares([t for t, _ in loaded], [p for _, p in loaded], device_bytes))
    tensors = [TensorPlan(t, info.qtype.name, info.nbytes, next(shares) if path is not None else info.nbytes)
               for (t, info), path in zip(listed, targets)]
    return Plan(name, "as stored", devices, tuple(tensors), layout)


def plan(name: str, *, quant: str | None, devices: int = 8, layout: str = "tp") -> Plan:
    """``zoo.plan``: the plan of a registry model's config preset (``configs/``) under a recipe."""
    return plan_config(registry.preset_config(registry.get_spec(name)), quant, devices, name, layout)
