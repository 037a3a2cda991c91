"""``zoo audit``: the weight-space comparison of a quantized GGUF with a reference GGUF, against a
direct numpy computation on the same files (read with gguf's own reader and dequantizer)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from gguf import GGUFReader
from gguf import quants as gq

from tests.support.audit_files import BANK, EXPERTS, MATRIX, NORM, ROWS
from tests.support.gguf_files import write_gguf
from zoo.cli import main
from zoo.formats.ggml import QType
from zoo.sources.base import SourceError
from zoo.sources.gguf import GGUFSource
from zoo.tools.audit import audit


def numpy_values(path, name: str) -> np.ndarray:
    """The tensor as gguf's reader and dequantizer give it, float64, numpy order."""
    t = next(t for t in GGUFReader(path).tensors if t.name == name)
    return gq.dequantize(t.data, t.tensor_type).astype(np.float64).reshape(tuple(reversed(t.shape.tolist())))


def numpy_metrics(q: np.ndarray, w: np.ndarray) -> tuple[float, float, float]:
    x = np.random.default_rng(0).standard_normal((w.shape[-1], 64))
    q, w = q.reshape(-1, w.shape[-1]), w.reshape(-1, w.shape[-1])
    return (np.linalg.norm(q - w) / np.linalg.norm(w), np.sum(q * w) / (np.linalg.norm(q) * np.linalg.norm(w)),
            np.linalg.norm((q - w) @ x) / np.linalg.norm(w @ x))


def test_numbers_equal_a_direct_numpy_computation(audit_files):
    quant, ref = audit_files
    rows = audit(quant, ref, ["blk.0.ffn_*", "blk.0.attn_*"], experts=EXPERTS, rows=ROWS)
    got = {(r.tensor, r.expert): r for r in rows}
    assert list(got) == [(BANK, 1), (BANK, 3), (BANK, "all"), (MATRIX, None), (NORM, None)]
    q, w = numpy_values(quant, BANK), numpy_values(ref, BANK)
    sel = np.s_[EXPERTS, ROWS[0]:ROWS[1]]
    expected = {(BANK, 1): numpy_metrics(q[1, 16:48], w[1, 16:48]), (BANK, 3): numpy_metrics(q[3, 16:48], w[3, 16:48]),
                (BANK, "all"): numpy_metrics(q[sel], w[sel]),
                (MATRIX, None): numpy_metrics(numpy_values(quant, MATRIX)[16:48], numpy_values(ref, MATRIX)[16:48]),
                (NORM, None): numpy_metrics(numpy_values(quant, NORM), numpy_values(ref, NORM))}
    for key, (rel, cos, matvec) in expected.items():
        r = got[key]
        print(f"{key}: rel_frob {r.rel_frob:.6f} cosine {r.cosine:.6f} matvec {r.matvec_rel:.6f} "
              f"(numpy {rel:.6f} {cos:.6f} {matvec:.6f})")
        np.testing.assert_allclose([r.rel_frob, r.cosine, r.matvec_rel], [rel, cos, matvec], rtol=1e-9, atol=1e-12)
    assert got[(BANK, 1)].rows == ROWS and (got[(BANK, 1)].quant_type, got[(BANK, 1)].ref_type) == ("Q4_0", "F32")
    assert (got[(MATRIX, None)].quant_type, got[(MATRIX, None)].ref_type) == ("Q8_0", "BF16")
    assert got[(NORM, None)].rel_frob == 0 and got[(NORM, None)].matvec_rel == 0
    assert 0.05 < got[(BANK, "all")].rel_frob < 0.2 and got[(MATRIX, None)].rel_frob < 0.01


def test_reads_only_the_chosen_experts_and_rows(audit_files):
    class Spy(GGUFSource):
        def read(self, key, index=()):
            calls.append((key, index))
            return super().read(key, index)

    calls = []
    audit(Spy(audit_files[0]), Spy(audit_files[1]), [BANK], experts=EXPERTS, rows=ROWS)
    assert calls == [(BANK, (e, slice(*ROWS))) for e in EXPERTS for _ in range(2)]


def test_cli_writes_the_table_and_json(audit_files, tmp_path, capsys):
    quant, ref = audit_files
    out = tmp_path / "audit.json"
    assert main(["audit", str(quant), str(ref), "--tensors", "blk.0.ffn_*", "--experts", "1,3", "--rows", "16:48",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert table.splitlines()[0].split()[:3] == ["tensor", "expert", "rows"] and "Q4_0" in table
    doc = json.loads(out.read_text())
    direct = audit(quant, ref, ["blk.0.ffn_*"], experts=EXPERTS, rows=ROWS)
    assert (doc["n_cols"], doc["seed"]) == (64, 0)
    assert [(r["expert"], r["rel_frob"], r["cosine"], r["matvec_rel"]) for r in doc["rows"]] == [
        (r.expert, r.rel_frob, r.cosine, r.matvec_rel) for r in direct]


def test_errors_name_the_file_and_tensor(audit_files, tmp_path):
    quant, ref = audit_files
    with pytest.raises(ValueError, match="quant.gguf: no tensor matches"):
        audit(quant, ref, ["nothing.*"])
    with pytest.raises(SourceError, match=f"quant.gguf: tensor '{BANK}' has 4 experts; expert 9"):
        audit(quant, ref, [BANK], experts=[9])
    with pytest.raises(SourceError, match=f"quant.gguf: tensor '{BANK}' has 64 rows; rows 60:70"):
        audit(quant, ref, [BANK], rows=(60, 70))
    other = write_gguf(tmp_path / "other.gguf", "glm5-next", [], {BANK: (np.ones((4, 32, 256), np.float32), QType.F32)})
    with pytest.raises(SourceError, match=f"tensor '{BANK}': shape .* in .*other.gguf"):
        audit(quant, other, [BANK])
    with pytest.raises(SourceError, match=f"other.gguf: no tensor '{MATRIX}'"):
        audit(quant, other, [MATRIX])
