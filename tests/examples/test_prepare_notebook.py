"""``examples/kaggle/prepare-on-cpu.ipynb`` on a tiny model: it builds the cache group by group,
compiles the decode program for a TPU v5e-8 with the real TPU compiler (libtpu, no TPU) and reports
that it fits, and leaves an entry that a later load (the TPU session's) restores."""

from __future__ import annotations

import re

import zoo
from tests.support.notebooks import NOTEBOOKS, outputs_text, run_notebook


def test_prepare_on_cpu_builds_compiles_and_leaves_a_restorable_entry(tmp_path):
    cache, attached = tmp_path / "cache", tmp_path / "kaggle-input"
    attached.mkdir()
    nb = run_notebook(NOTEBOOKS / "prepare-on-cpu.ipynb",
                      {"MODEL": "qwen38-tiny", "QUANT": "int8", "MESH": "tp", "DEVICES": 8, "INSTALL": None,
                       "GGUF": None, "CACHE_DIR": str(cache), "PUSH_DATASET": None, "COMPILE_PROGRAMS": "decode"},
                      tmp_path, env={"ZOO_CACHE_SEARCH": str(attached)})
    text = outputs_text(nb)
    peak_gb = float(re.search(r"peak resident memory of the build ([0-9.]+) GB", text)[1])
    assert 0 < peak_gb < 24
    compiled = re.findall(r"decode B=\d+ L=\d+[^\n]*? peak +([0-9.]+) GiB of ([0-9.]+) +margin .* fits: True", text)
    # without drafts, with drafts, and the auto speculation policy's step with drafting off
    assert len(compiled) == 3 and all(0 < float(p) < float(u) for p, u in compiled)
    assert "every program fits" in text
    entry = next(cache.glob("*/manifest.json")).parent
    assert f"{entry.name}: " in text and '"quant": "int8"' in text
    model = zoo.load("qwen38-tiny", quant="int8", cache=cache)        # what the TPU session does with it
    assert model.load_info["source"] == "cache" and model.load_info["cache_path"] == str(entry)
