"""A small GLM-MoE-shaped pair of GGUF files for the quantization-audit notebook: a BF16 / F32
reference and a quantized copy with a different ggml type per tensor class and layer (the types
gguf's numpy quantizer writes), so the audit's table and per-layer plot have several series.

    write_audit_model(dir) -> (quant_path, ref_path)       about 4.7 MB + 1.8 MB

Per layer ``blk.0`` .. ``blk.3`` (numpy-order shapes, random normal weights):

    attn_q.weight          [256, 256]      ref BF16   quant Q8_0
    attn_norm.weight       [256]           ref F32    quant F32 (an exact copy: rel_frob 0)
    ffn_gate_exps.weight   [4, 256, 256]   ref BF16   quant Q5_1 in the first and last layer, Q4_0 between
    ffn_down_exps.weight   [4, 256, 256]   ref BF16   quant Q5_0 in the first and last layer, MXFP4 between
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.support.gguf_files import write_gguf
from zoo.formats.ggml import QType

LAYERS, EXPERTS, HIDDEN, FF, Q_ROWS = 4, 4, 256, 256, 256


def quant_types(layer: int) -> dict[str, QType]:
    """The quantized copy's type of each tensor class in ``layer``."""
    edge = layer in (0, LAYERS - 1)
    return {"attn_q": QType.Q8_0, "attn_norm": QType.F32,
            "ffn_gate_exps": QType.Q5_1 if edge else QType.Q4_0,
            "ffn_down_exps": QType.Q5_0 if edge else QType.MXFP4}


REF_TYPES = {"attn_q": QType.BF16, "attn_norm": QType.F32, "ffn_gate_exps": QType.BF16, "ffn_down_exps": QType.BF16}


def model_tensors(seed: int = 0) -> dict[str, np.ndarray]:
    """``{GGUF name: float32 array}`` of the model (scaled like trained weights, ~1/sqrt(in))."""
    rng = np.random.default_rng(seed)
    out = {}
    for n in range(LAYERS):
        out[f"blk.{n}.attn_q.weight"] = rng.standard_normal((Q_ROWS, HIDDEN), np.float32) / 16
        out[f"blk.{n}.attn_norm.weight"] = 1 + 0.1 * rng.standard_normal(HIDDEN, np.float32)
        out[f"blk.{n}.ffn_gate_exps.weight"] = rng.standard_normal((EXPERTS, FF, HIDDEN), np.float32) / 16
        out[f"blk.{n}.ffn_down_exps.weight"] = rng.standard_normal((EXPERTS, HIDDEN, FF), np.float32) / 16
    return out


def write_audit_model(directory: str | Path) -> tuple[Path, Path]:
    """Write ``ref.gguf`` and ``quant.gguf`` in ``directory``; returns (quant path, ref path)."""
    directory = Path(directory)
    tensors = model_tensors()
    cls = lambda name: name.split(".")[2]
    ref = write_gguf(directory / "ref.gguf", "glm5-next", [],
                     {k: (v, REF_TYPES[cls(k)]) for k, v in tensors.items()})
    quant = write_gguf(directory / "quant.gguf", "glm5-next", [],
                       {k: (v, quant_types(int(k.split(".")[1]))[cls(k)]) for k, v in tensors.items()})
    return quant, ref
