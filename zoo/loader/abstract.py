"""The abstract load: the whole model for a name and a recipe, without any weight file.

    abstract_module(cfg, quant, dtype, mesh) -> nnx.Module

Every parameter holds an abstract value of the kind the recipe stores it as, with the sharding the
loader would place it with on ``mesh``: ``jax.ShapeDtypeStruct`` leaves inside a ``QArray`` (its
planes, packed per device as the loader packs them), an ``Int8Weight`` (int8 + f32 scales), or a
dense array in the parameter dtype. Nothing is read and nothing is allocated, so a full-size model
can be lowered and compiled for a target it does not fit on this machine (``zoo.tools.compile``).

What each parameter is stored as comes from the architecture's tensor inventory (GGUF names, the
planner's) under the recipe (``Recipe.kind_of``), mapped to the parameters by the architecture's
GGUF name map; then the recipe's load policy says what the loader makes of that kind:

    as_stored    a ggml block type -> QArray of it; FP8 / BF16 / F16 / F32 -> dense in the parameter dtype
    dequantized  everything dense
    Q8_0         Q8_0 -> QArray; the rest dense
    int8         INT8 -> Int8Weight; the rest dense
    int8_unless_quantized   a ggml block type -> QArray of it; every other matmul weight -> Int8Weight
    None         (no recipe: a float checkpoint as stored) everything dense

``param_kinds`` is the mapping alone; the tests check that an abstract load has exactly the leaves
(kind, shape, dtype) of a real load of the same checkpoint and recipe.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from zoo import registry
from zoo.formats import planes as P
from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.loader.apply_recipe import recipe_of, whole_gguf
from zoo.loader.gguf_model import config_from_gguf
from zoo.loader.open import without_vision
from zoo.models.architectures import architecture
from zoo.models.config import load_config
from zoo.quant.int8 import Int8Weight
from zoo.quant.qarray import QArray
from zoo.quant.recipe import Recipe
from zoo.sharding.mesh import sharding_rule
from zoo.sources.gguf import GGUFSource
from zoo.sources.names import NameMap, Target, Transform, layout_transform

DENSE = "dense"


def inventory_targets(cfg) -> list[tuple[object, Target]]:
    """``(inventory tensor, its target)`` for every tensor of the architecture's inventory, through
    its GGUF name map (a join part resolves to the joined tensor's target). Raises ``ValueError``
    for a tensor the map does not place."""
    arch = architecture(cfg.arch)
    names = arch.gguf_name_map(cfg)
    inventory = arch.part("inventory")(cfg)
    joined = names.joined_names(t.name for t in inventory)
    out = []
    for t in inventory:
        target = names.resolve(joined.get(t.name, t.name))
        if target is None:
            raise ValueError(f"inventory tensor {t.name} of {cfg.arch} maps to no parameter")
        out.append((t, target))
    return out


def _stored_kind(kind: str, load: str | None, target: Target) -> str:
    """What the loader stores a tensor of planned ``kind`` as, under load policy ``load``: only a
    parameter in the matmul layout (its transform's ``LayoutTransform.matmul``) may stay quantized."""
    if not layout_transform(target.transform).matmul:
        return DENSE
    block = kind in QType.__members__ and BLOCK_LAYOUTS[QType[kind]].block_size > 1
    if load == "as_stored" and block:
        return kind
    if load == "Q8_0" and kind == "Q8_0":
        return kind
    if load == "int8" and kind == "INT8":
        return "INT8"
    if load == "int8_unless_quantized":           # a source's blocks as stored, every float matmul weight int8
        return kind if block else "INT8"
    return DENSE


def param_kinds(cfg, recipe: Recipe | None) -> dict[str, tuple[str, Target]]:
    """``{parameter path: (stored kind, the target of its (first) inventory tensor)}``: a ggml type
    name (a QArray), "INT8" (an Int8Weight) or "dense". A parameter the recipe takes from a GGUF
    (``gguf_part``) keeps the GGUF map's transform (a head permutation becomes the QArray's input
    order); the others come from the HF checkpoint, whose layout has none."""
    if recipe is not None and recipe.plan is None:
        raise ValueError(f"recipe {recipe.name!r} of {cfg.arch} is a whole GGUF: its per-tensor types are the "
                         f"file's; load the file abstractly instead (zoo.load(FILE.gguf, weights=False))")
    from_gguf = re.compile(recipe.gguf_part.params) if recipe is not None and recipe.gguf_part else None
    out: dict[str, tuple[str, Target]] = {}
    for t, target in inventory_targets(cfg):
        if from_gguf is None or not from_gguf.match(target.path):      # from the HF checkpoint: no
            layout = target.transform.layout if isinstance(target.transform, Transform) else target.transform
            target = target._replace(transform=layout)                  # GGUF head permutation
        kind = DENSE if recipe is None else _stored_kind(recipe.kind_of(t), recipe.load, target)
        out.setdefault(target.path, (kind, target))
    return out


def gguf_param_kinds(source, names: NameMap) -> dict[str, tuple[str, Target]]:
    """The same for a GGUF file's own tensors (its header: every tensor as stored)."""
    out: dict[str, tuple[str, Target]] = {}
    for key in source.keys():
        target = names.resolve(key)
        if target is None:
            continue
        info = source.info(key)
        quantized = getattr(info, "quantized", False) and layout_transform(target.transform).matmul
        out.setdefault(target.path, (info.qtype.name if quantized else DENSE, target))
    return out


def _in_order(target: Target, shape: tuple[int, ...]):
    """A QArray's input order from a head permutation of the stored columns (``qarray_value``)."""
    heads = target.transform.heads if isinstance(target.transform, Transform) else None
    if heads is None or heads.axis != len(shape) - 1:
        return None
    return heads.as_view(shape[-2])


def _prototype(kind: str, target: Target, want: jax.ShapeDtypeStruct):
    """A global abstract value of ``kind`` for a parameter ``want`` (one packing part)."""
    shape = tuple(want.shape)
    if kind == DENSE:
        return jax.ShapeDtypeStruct(shape, want.dtype)
    if kind == "INT8":
        return Int8Weight(q=jax.ShapeDtypeStruct(shape, jnp.int8),
                          scale=jax.ShapeDtypeStruct((*shape[:-2], shape[-1]), jnp.float32))
    qtype = QType[kind]
    *lead, d_in, d_out = shape
    planes = {k: jax.ShapeDtypeStruct(s, jnp.uint32) for k, s in P.plane_shapes(
        qtype, tuple(lead), d_out, d_in // BLOCK_LAYOUTS[qtype].block_size).items()}
    return QArray(planes, qtype, shape, _in_order(target, shape))


def _placed(proto, axes, shape: tuple[int, ...], mesh):
    """``proto`` as the loader places it on ``mesh``: its kind's placement split, leaves with shardings."""
    rule = sharding_rule(proto)
    spec = rule.placement_spec(proto, tuple(axes), shape, mesh)
    glob = rule.assemble(proto, shape, spec, mesh)
    leaves = [jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, s))
              for leaf, s in zip(jax.tree.leaves(glob), rule.leaf_specs(glob, spec))]
    return jax.tree.unflatten(jax.tree.structure(glob), leaves)


def abstract_module(cfg, kinds: dict[str, tuple[str, Target]], dtype, mesh=None) -> nnx.Module:
    """The model of ``cfg`` with every parameter an abstract value of its stored kind (``kinds``,
    from ``param_kinds`` / ``gguf_param_kinds``; a parameter not listed is dense), placed on ``mesh``."""
    model_class = architecture(cfg.arch).model_class()
    abstract = nnx.eval_shape(lambda: model_class(cfg, dtype=dtype))
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    for path, var in flat:
        key = ".".join(map(str, path))
        want = var.get_value()
        kind, target = kinds.get(key, (DENSE, None))
        if kind in QType.__members__ and want.shape[-2] % BLOCK_LAYOUTS[QType[kind]].block_size:
            kind = DENSE                                    # the loader's own rule: whole blocks only
        value = _prototype(kind, target, want)
        if mesh is not None:
            value = _placed(value, var.get_metadata()["axes"], tuple(want.shape), mesh)
        var.set_value(value)
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


def abstract_load(name_or_path, quant: str | None, dtype, mesh=None, vision: bool = True) -> tuple[nnx.Module, object]:
    """``(abstract module, config)`` from a config alone: a registry name's preset (no download), a
    checkpoint directory's config.json under the recipe ``quant``, or a GGUF's header (its tensors'
    own types; also the GGUF a whole-GGUF recipe names in a checkpoint directory)."""
    path = Path(name_or_path).expanduser()
    gguf = None
    if path.is_file() and path.suffix == ".gguf":
        gguf = path
    elif path.is_dir():
        cfg = load_config(path)
        gguf = whole_gguf(recipe_of(quant, cfg.arch), path)
    else:
        cfg = registry.preset_config(registry.get_spec(str(name_or_path)))
    if gguf is not None:
        source = GGUFSource(gguf)
        cfg = config_from_gguf(source)
        kinds = gguf_param_kinds(source, architecture(cfg.arch).gguf_name_map(cfg))
    else:
        if not vision:
            cfg = without_vision(cfg)
        kinds = param_kinds(cfg, recipe_of(quant, cfg.arch))
    return abstract_module(cfg, kinds, dtype, mesh), cfg


def shard_bytes_of(tree) -> int:
    """Bytes one device holds of a tree of arrays or ShapeDtypeStructs (by each leaf's sharding)."""
    total = 0
    for leaf in jax.tree.leaves(tree):
        sharding = getattr(leaf, "sharding", None)
        shape = sharding.shard_shape(leaf.shape) if sharding is not None else leaf.shape
        total += math.prod(shape) * np.dtype(leaf.dtype).itemsize
    return total


def shard_bytes(module: nnx.Module) -> int:
    """Bytes one device holds of a module's parameters (abstract or real)."""
    return shard_bytes_of(nnx.state(module))
