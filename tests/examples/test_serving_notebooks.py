"""The two serving notebooks (``examples/kaggle/glm53-flash-v5e-8.ipynb``, ``qwen38-27b.ipynb``) run top
to bottom on the tiny models, substituted through their parameters: the GLM one on a first run (no
cache attached: it builds the cache, then serves from it), the Qwen one with a cache attached as a
Kaggle dataset (found under the search root by its fingerprint, restored, nothing built). Each
starts ``zoo serve`` twice (with and without MTP drafts), talks to it with the openai SDK and
measures; the notebooks' own last cells check that every measurement produced tokens."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.support.notebooks import NOTEBOOKS, outputs_text, run_notebook

COMMON = {"INSTALL": None, "GGUF": None, "PUSH_DATASET": None, "MAX_TOKENS": 8, "BATCHES": [1, 3],
          "SERVE_ARGS": ["--max-batch", "4", "--context", "1024", "--prefill-chunk", "64"]}
EIGHT_CPUS = {"XLA_FLAGS": (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()}


def sweep_of(text: str) -> list[dict]:
    """The throughput results the notebook printed (a JSON list)."""
    start = text.index('[\n {\n  "label"')
    return json.loads(text[start:text.index("]", start) + 1])


def own_tmp(tmp_path) -> dict:
    """The notebook's temporary directory (``TMPDIR``): a folder of the test's own."""
    (tmp_path / "tmp").mkdir()
    return {"TMPDIR": str(tmp_path / "tmp")}


def assert_no_server_logs_left(tmp_path) -> None:
    """Its servers (``zoo.kaggle.ZooServer``) exited cleanly and removed their logs."""
    left = sorted(p.name for p in (tmp_path / "tmp").glob("zoo-serve-*.log"))
    assert not left, left


def test_glm_notebook_first_run_builds_the_cache_and_serves_from_it(tmp_path):
    """Its servers compile lazily (``--no-warmup``: the programs its requests use, not the whole set;
    measured alone: 76 s against 102 s); the Qwen notebook below checks the warmup."""
    cache, attached = tmp_path / "cache", tmp_path / "kaggle-input"
    attached.mkdir()
    lazy = {**COMMON, "SERVE_ARGS": [*COMMON["SERVE_ARGS"], "--no-warmup"]}
    nb = run_notebook(NOTEBOOKS / "glm53-flash-v5e-8.ipynb",
                      {**lazy, "MODEL": "glm53-tiny", "QUANT": "int8", "MESH": "ep", "DEVICES": 8,
                       "CACHE_DIR": str(cache), "COMPILE_CACHE": str(tmp_path / "programs")}, tmp_path,
                      env={**EIGHT_CPUS, "ZOO_CACHE_SEARCH": str(attached), **own_tmp(tmp_path)})
    text = outputs_text(nb)
    assert_no_server_logs_left(tmp_path)
    assert "no matching cache: the model loads from its sources" in text
    assert re.search(r"built in \d+ s", text)
    entries = [p.parent for p in cache.glob("*/manifest.json")]
    assert [e.name.startswith("glm53-tiny-") for e in entries] == [True]
    # both servers restored that entry (the first "restored from" line is the MTP server's)
    assert f"restored from {entries[0]} in" in text
    assert "routed_experts" in text                                   # the plan's classes
    speedup = float(re.search(r"MTP speed-up: ([0-9.]+)x", text)[1])
    assert speedup > 0
    sweep = sweep_of(text)
    assert sorted((r["label"], r["batch"]) for r in sweep) == sorted(
        (label, b) for label in ("MTP k=3", "no MTP") for b in (1, 3))
    assert all(r["tokens_per_s"] > 0 for r in sweep)
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 2                                           # the plan and the throughput


def test_qwen_notebook_restores_an_attached_dataset(tmp_path):
    attached, cache = tmp_path / "kaggle-input", tmp_path / "cache"
    dataset = attached / "my-qwen-cache"
    built = subprocess.run([sys.executable, "-m", "zoo", "cache", "build", "qwen38-tiny", "--dir", str(dataset)],
                           capture_output=True, text=True)
    assert built.returncode == 0, built.stderr[-2000:]
    entry = next(dataset.glob("*/manifest.json")).parent
    text = tmp_path / "eval.txt"
    text.write_text("the model reads the text and the quant changes what it predicts next. " * 60)
    nb = run_notebook(NOTEBOOKS / "qwen38-27b.ipynb",
                      {**COMMON, "MODEL": "qwen38-tiny", "QUANT": None, "MESH": None, "DEVICES": 1,
                       "CACHE_DIR": str(cache), "COMPILE_CACHE": str(tmp_path / "programs"),
                       "EVAL_REFERENCE": {"quant": None, "dtype": "float32"}, "EVAL_TEXT": str(text),
                       "EVAL_CTX": 64, "EVAL_CHUNKS": 2, "EVAL_DIR": str(tmp_path / "eval")}, tmp_path,
                      env={"ZOO_CACHE_SEARCH": str(attached), **own_tmp(tmp_path)})
    text = outputs_text(nb)
    assert_no_server_logs_left(tmp_path)
    assert f"restores {entry} (" in text
    assert "built in" not in text and not cache.exists()              # nothing built, nothing written
    assert text.count(f"restored from {entry} in") == 1               # the MTP server (the plain one: quiet)
    assert re.search(r"MTP speed-up: [0-9.]+x", text)
    assert {r["batch"] for r in sweep_of(text)} == {1, 3}
    assert re.search(r"ready: \d+ programs in [0-9.]+s \(\d+ compiled", text)   # warmed before serving
    # section 5: the model as stored (bfloat16, the attached cache) against its float32 self, 2 x 31 tokens
    quality = re.search(r"as stored: mean KL divergence ([0-9.]+) .* top-1 agreement ([0-9.]+)%.* over (\d+) tokens",
                        text)
    assert quality and 0 < float(quality[1]) < 0.1 and float(quality[2]) > 50 and quality[3] == "62"
    # its files in EVAL_DIR (a run leaves nothing in /tmp): the reference logits and the per-token KLs
    assert sorted(p.name for p in (tmp_path / "eval").iterdir()) == ["base.npz", "kld-as stored.npz"]
    images = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) == 4                           # the plan, the throughput, KL by recipe, KL per token
