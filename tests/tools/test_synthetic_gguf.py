"""Full-width synthetic GGUFs (``zoo.tools.synthetic_gguf``, the files of ``bench/scale.py``) in the
suite's reduced form: a few full-width layers and a small vocabulary. The file describes the config it
was written for (read back through the loader's own GGUF config reader), its header parses exactly as
gguf-py's reader parses it, ``zoo inspect`` / ``zoo plan`` read it, and a Qwen3.8-27B slice loads and
generates (the bench runs the whole 12.9 GB model)."""

from __future__ import annotations

import contextlib
import io
import json
import math

import numpy as np
import pytest
from gguf import GGUFReader

from tests.support.paths import DATA
from zoo.loader.gguf_model import config_from_gguf
from zoo.sources.gguf import GGUFSource
from zoo.tools.synthetic_gguf import described, pick_layers, synthetic_config, vocabulary, write_synthetic_gguf

QWEN = dict(name="qwen38-27b", layers=2, vocab=4096)        # a DeltaNet layer and a gated-attention layer
GLM = dict(name="glm53-flash", layers=3, vocab=4096, overrides={"n_routed_experts": 8, "num_experts_per_tok": 2})


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The two files (2.0 GB together), deleted when the module is done: the suite's disk footprint
    stays small on a machine with little free space."""
    root = tmp_path_factory.mktemp("synthetic")
    paths = {spec["name"]: write_synthetic_gguf(root / f"{spec['name']}.gguf", **spec) for spec in (QWEN, GLM)}
    yield paths
    for path in paths.values():
        path.unlink(missing_ok=True)


def cli(*argv) -> tuple[int, str]:
    from zoo.cli import main
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(list(argv))
    return code, out.getvalue()


@pytest.mark.parametrize("spec", [QWEN, GLM], ids=lambda s: s["name"])
def test_the_file_describes_its_config_at_full_width(files, spec):
    src = GGUFSource(files[spec["name"]])
    cfg = synthetic_config(spec["name"], spec["layers"], spec["vocab"], spec.get("overrides"))
    assert described(config_from_gguf(src)) == described(cfg)
    full = synthetic_config(spec["name"])
    assert cfg.hidden_size == full.hidden_size and cfg.num_hidden_layers == spec["layers"] < full.num_hidden_layers
    kinds = {t for t in full.layer_types}
    assert set(cfg.layer_types) == kinds                       # every kind of layer the model has
    types = {src.info(k).qtype.name for k in src.keys()}
    assert {"Q4_K", "Q6_K", "Q8_0", "F32", "IQ3_XXS", "IQ2_S", "IQ3_S", "Q3_K"} <= types, types
    tokens = src.metadata["tokenizer.ggml.tokens"]
    assert len(tokens) == spec["vocab"] == len(set(tokens)) and src.info("token_embd.weight").shape[0] == spec["vocab"]


def test_layers_keep_every_kind_first():
    hf = {"num_hidden_layers": 8, "layer_types": ["a", "a", "a", "b"] * 2, "mlp_layer_types": ["d"] * 2 + ["s"] * 6}
    assert pick_layers(hf, 3) == [0, 2, 3]                     # (a, d), (a, s), (b, s): first of each
    assert pick_layers(hf, 5) == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="cannot hold the model's 3 kinds"):
        pick_layers(hf, 2)
    with pytest.raises(ValueError, match="layers must be 1..8"):
        pick_layers(hf, 9)


def test_the_grown_vocabulary_is_a_working_bpe():
    """248,320 tokens (the real model's count) of a few characters each, merges that build them; the
    tokenizer the loader makes of it round-trips text."""
    from zoo.text.gguf_vocab import tokenizer_from_gguf

    md = vocabulary("qwen38", 248_320)
    tokens = md["tokenizer.ggml.tokens"]
    assert len(tokens) == len(set(tokens)) == 248_320 and np.mean([len(t) for t in tokens]) < 16
    assert len(md["tokenizer.ggml.merges"]) > 240_000

    class Source:
        metadata = md
    tok = tokenizer_from_gguf(Source())
    text = "The model reads 12 files, then edits main.py.\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text and max(ids) < 248_320


LLAMA_CPP_FILES = ["qwen38-q256-udmix.gguf", "glm53-q256-udmix.gguf", "glm53-tiny-mtp-f32.gguf"]


@pytest.mark.parametrize("path", [*LLAMA_CPP_FILES, "synthetic"])
def test_the_header_parses_as_gguf_py_parses_it(files, path):
    """``parse_header`` (one pass, numpy for number arrays) against gguf-py's ``GGUFReader``: the same
    metadata values and the same tensors (llama.cpp's files and a synthetic one)."""
    path = files["qwen38-27b"] if path == "synthetic" else DATA / path
    reader = GGUFReader(path)
    want = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}
    src = GGUFSource(path)
    assert src.metadata == {**want, **{k: v for k, v in src.metadata.items() if k.startswith("split.")}}
    got = [(k, src.info(k).offset, src.info(k).nbytes, src.info(k).qtype, src.info(k).shape) for k in src.keys()]
    assert got == [(t.name, int(t.data_offset), int(t.n_bytes), t.tensor_type,
                    tuple(int(d) for d in reversed(t.shape.tolist()))) for t in reader.tensors]


def test_inspect_and_plan_read_the_gguf_header(files):
    """``zoo inspect FILE.gguf`` (it used to read the file as config.json text and fail) gives the config
    and every tensor with its type; ``zoo plan`` the same bytes."""
    path = files["qwen38-27b"]
    code, text = cli("inspect", str(path), "--tensors")
    assert code == 0
    doc = json.loads(text[:text.index("\n}\n") + 3])
    assert doc["arch"] == "qwen38" and doc["config"]["hidden_size"] == 5120 and doc["config"]["num_hidden_layers"] == 2
    src = GGUFSource(path)
    total = sum(src.info(k).nbytes for k in src.keys())
    assert f"{len(src.keys())} tensors, {total / 1e9:.3f} GB" in text
    assert "blk.1.attn_q.weight" in text and "IQ3_XXS" in text
    code, text = cli("plan", str(path), "--json")
    assert code == 0 and abs(json.loads(text)["total_bytes"] - total) <= 0.001 * total


def test_a_full_width_qwen_slice_loads_and_generates(files):
    """Two full-width layers of Qwen3.8-27B (hidden 5120, 17,408-wide MLP; a DeltaNet and a gated-
    attention layer) from their low-bit blocks, as stored: the model loads, every matmul weight stays
    in its own ggml type, and greedy decoding runs (the engine refuses non-finite logits)."""
    import zoo
    from zoo.quant.qarray import QArray

    model = zoo.load(files["qwen38-27b"])
    cfg = model.config
    assert cfg.hidden_size == 5120 and cfg.intermediate_size == 17408
    assert tuple(cfg.layer_types) == ("linear_attention", "full_attention")
    up = model.module.layers[0].mlp.up_proj.kernel.get_value()
    assert isinstance(up, QArray) and up.qtype.name == "IQ3_XXS" and math.prod(up.shape) == 5120 * 17408
    out = model.generate([[1, 2, 3, 4]], max_new_tokens=2)[0]
    assert len(out.tokens) == 2 and all(0 <= t < 4096 for t in out.tokens)
