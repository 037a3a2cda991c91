"""Per-device bytes of an inventory tensor (``zoo.tools.plan``) under a mesh layout (``zoo.sharding.mesh``).

Every llama.cpp tensor of the inventories gets the logical axes its parameter has in the model,
in the tensor's numpy order (``[out, in]``, banks ``[E, out, in]``), so the planner splits exactly
as ``zoo.load(..., mesh=...)`` places: the layout's rules, a mesh axis at most once per tensor, a
dimension kept whole where the mesh axis does not divide it, and the input axis of a block-quantized
tensor split only in whole blocks. A quantized expert bank is counted in the plane layout of one
device's slice (``plane_nbytes``: each device packs its own blocks, as the loader does).
"""

from __future__ import annotations

import math
import re

from jax.sharding import AbstractMesh

from zoo.formats.ggml import BLOCK_LAYOUTS, QType
from zoo.formats.planes import plane_nbytes
from zoo.sharding.mesh import Axes, get_layout, partition_spec

_MLP = {f"ffn_{p}{s}": (("embed", "mlp") if p == "down" else ("mlp", "embed"))
        for p in ("gate", "up", "down") for s in ("", "_shexp")}

# tensor name without ``blk.N.`` and ``.weight``/``.bias`` -> logical axes in numpy order
NUMPY_AXES: dict[str, Axes] = {
    "token_embd": ("vocab", "embed"), "output": ("vocab", "embed"), "output_norm": ("embed",),
    "attn_norm": ("embed",), "post_attention_norm": ("embed",), "ffn_norm": ("embed",),
    "nextn.eh_proj": ("embed", None), "nextn.enorm": ("embed",), "nextn.hnorm": ("embed",),
    "nextn.shared_head_norm": ("embed",),
    **{f"hc_{s}_{p}": a for s in ("attn", "ffn")
       for p, a in (("fn", ("hc", "hc_embed")), ("base", ("hc",)), ("scale", ("hc_scale",)))},
    # attention / KDA projections (q, k, v, output), DeltaNet, KDA extras
    "attn_q": ("heads", "embed"), "attn_k": ("kv_heads", "embed"), "attn_v": ("kv_heads", "embed"),
    "attn_output": ("embed", "heads"), "attn_q_norm": ("head_dim",), "attn_k_norm": ("head_dim",),
    "attn_qkv": ("linear_qkv", "embed"), "attn_gate": ("linear_v", "embed"), "ssm_out": ("embed", "linear_v"),
    "ssm_alpha": ("linear_heads", "embed"), "ssm_beta": ("linear_heads", "embed"),
    "ssm_conv1d": ("linear_qkv", "conv"), "ssm_a": ("linear_heads",), "ssm_dt": ("linear_heads",),
    "ssm_norm": ("head_dim",),
    **{f"ssm_conv1d_{p}": ("heads", None, "conv") for p in "qkv"},
    "ssm_f_a": ("head_dim", "embed"), "ssm_f_b": ("heads", "head_dim"),
    "ssm_g_a": ("head_dim", "embed"), "ssm_g_b": ("heads", "head_dim"),
    # MLA and its indexer
    "attn_q_a": ("q_lora", "embed"), "attn_q_a_norm": ("q_lora",), "attn_q_b": ("heads", "q_lora"),
    "attn_kv_a_mqa": ("kv_lora", "embed"), "attn_kv_a_norm": ("kv_lora",),
    "attn_k_b": ("heads", "kv_lora", "head_dim"), "attn_v_b": ("heads", "head_dim", "kv_lora"),
    "indexer.attn_q_b": ("heads", "q_lora"), "indexer.attn_k": ("head_dim", "embed"),
    "indexer.k_norm": ("head_dim",), "indexer.proj": ("heads", "embed"),
    "indexer_compressor_ape": ("kpool", "head_dim"), "indexer_compressor_gate": ("head_dim", "embed"),
    # MLPs, router, routed experts
    **_MLP, "ffn_gate_inp": ("experts", "embed"), "exp_probs_b": ("experts",),
    "ffn_gate_exps": ("experts", "mlp", "embed"), "ffn_up_exps": ("experts", "mlp", "embed"),
    "ffn_down_exps": ("experts", "embed", "mlp"),
}


def tensor_axes(name: str, ndim: int) -> Axes | None:
    """The logical axes of an inventory tensor (None: not a tensor of the model, kept whole)."""
    base = re.sub(r"\.(weight|bias)$", "", re.sub(r"^blk\.\d+\.", "", name))
    axes = NUMPY_AXES.get(base)
    return axes if axes is not None and len(axes) == ndim else None


def plan_mesh(layout: str, devices: int) -> AbstractMesh:
    """The abstract mesh ``zoo.sharding.mesh.make_mesh(layout)`` builds on ``devices`` devices."""
    lay = get_layout(layout)
    return AbstractMesh(lay.mesh_shape(devices), lay.axis_names)


def per_device_bytes(name: str, shape: tuple[int, ...], kind: str, nbytes: int, mesh) -> int:
    """Bytes one device holds of a tensor stored as ``kind`` (``nbytes`` in all) on ``mesh``."""
    axes = tensor_axes(name, len(shape))
    if axes is None:
        return nbytes
    block = BLOCK_LAYOUTS[QType[kind]].block_size if kind in QType.__members__ else 1
    spec = partition_spec(axes, shape, mesh, (1,) * (len(shape) - 1) + (block,))
    ways = [mesh.shape[a] if a is not None else 1 for a in spec]
    if block > 1 and len(shape) == 3 and name.endswith("_exps.weight"):
        e, rows, cols = shape
        return e // ways[0] * plane_nbytes(QType[kind], rows // ways[1], cols // block // ways[2])
    return -(-nbytes // math.prod(ways))
