"""The two GGUF files the audit tests compare (a reference and its quantized copy)."""

from __future__ import annotations

import numpy as np

from tests.support.gguf_files import write_gguf
from zoo.formats.ggml import QType

BANK, MATRIX, NORM = "blk.0.ffn_gate_exps.weight", "blk.0.attn_q.weight", "blk.0.attn_norm.weight"
EXPERTS, ROWS = [1, 3], (16, 48)


def write_audit_files(tmp_path_factory):
    """A reference GGUF (F32 bank and norm, BF16 matrix) and its quantized copy (Q4_0, Q8_0, F32)."""
    tmp = tmp_path_factory.mktemp("audit")
    rng = np.random.default_rng(1)
    bank = rng.standard_normal((4, 64, 256)).astype(np.float32)
    matrix = rng.standard_normal((96, 256)).astype(np.float32) / 16
    norm = 1 + 0.1 * rng.standard_normal(256).astype(np.float32)
    ref = write_gguf(tmp / "ref.gguf", "glm5-next", [],
                     {BANK: (bank, QType.F32), MATRIX: (matrix, QType.BF16), NORM: (norm, QType.F32)})
    quant = write_gguf(tmp / "quant.gguf", "glm5-next", [],
                       {BANK: (bank, QType.Q4_0), MATRIX: (matrix, QType.Q8_0), NORM: (norm, QType.F32)})
    return quant, ref
