"""``examples/kaggle/quantization-audit.ipynb`` run top to bottom in a fresh kernel (papermill) on a
small GLM-MoE-shaped GGUF pair written here, as a Kaggle user would run it on the real files."""

from __future__ import annotations

import json
import math

from tests.support.audit_model_files import LAYERS, REF_TYPES, quant_types, write_audit_model
from tests.support.notebooks import NOTEBOOKS, outputs_text, run_notebook

NOTEBOOK = NOTEBOOKS / "quantization-audit.ipynb"


def test_audit_notebook_runs_and_writes_every_layer_and_class(tmp_path):
    quant, ref = write_audit_model(tmp_path / "model")
    out = tmp_path / "audit.json"
    nb = run_notebook(NOTEBOOK, {"INSTALL": None, "QUANT_GGUF": str(quant), "REF_GGUF": str(ref),
                                 "EXPERTS": [1, 3], "ROWS": [0, 128], "OUT": str(out)}, cwd=tmp_path)
    doc = json.loads(out.read_text())
    assert (doc["quant"], doc["ref"]) == (str(quant), str(ref))
    rows = doc["rows"]
    summary = {(r["tensor"], r["expert"]): r for r in rows}
    for layer in range(LAYERS):
        for cls, qtype in quant_types(layer).items():
            name = f"blk.{layer}.{cls}.weight"
            bank = cls.endswith("_exps")
            keys = [(name, 1), (name, 3), (name, "all")] if bank else [(name, None)]
            for key in keys:
                r = summary[key]
                assert (r["quant_type"], r["ref_type"]) == (qtype.name, REF_TYPES[cls].name), key
                assert r["rows"] == ([0, 128] if cls != "attn_norm" else [0, 1]), key     # a vector: one row, whole
                assert math.isfinite(r["rel_frob"]) and r["cosine"] > 0.99, key
                assert (r["rel_frob"] == 0) == (qtype.name == "F32"), key
    assert len(rows) == LAYERS * (2 + 2 * 3)
    text = outputs_text(nb)
    assert f"audited {len(rows)} rows in" in text
    header = next(line for line in text.splitlines() if line.startswith("class"))
    assert header.split()[:3] == ["class", "quant", "ref"]
    for cls, qtype in [("ffn_down_exps", "MXFP4"), ("ffn_gate_exps", "Q5_1"), ("attn_q", "Q8_0")]:
        assert any(line.split()[:2] == [cls, qtype] for line in text.splitlines()), (cls, qtype)
    assert "checked 32 rows of 6 (class, type) groups" in text
    assert (tmp_path / "audit.png").stat().st_size > 0
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 1
