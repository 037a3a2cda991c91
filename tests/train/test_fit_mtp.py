"""``zoo fit-mtp`` and MTP overlays (``zoo.train.fit_mtp``, ``zoo.loader.overlay``), on CPU.

- The command line end to end on qwen38-tiny quantized at load (Q8_0, bfloat16; random weights: its
  MTP head never agrees with the model, acceptance ~0): ``zoo fit-mtp`` raises the real speculative
  decoder's greedy acceptance on held-out prompts; ``zoo.load(..., mtp=DIR)`` gives the fitted
  parameters bit-identically (the overlay's float32 tensors cast as a load casts), the main model
  untouched, and the same acceptance; ``zoo generate --mtp DIR --spec 2`` runs.
- The same quantized load of a checkpoint without an MTP layer: fit-mtp starts a new layer from the
  model's own layers and the overlay adds the layer to a later load (the fit itself is the same path).
- A quantized MTP layer trains as float32 (dequantized), only the chosen subset, the rest frozen.
- One fit in all: each compiles the speculative decoder twice and the training step.
- Broken overlays: each a clear error, raised before anything is applied.
"""

from __future__ import annotations

import contextlib
import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

import zoo
from tests.support.paths import DATA
from tests.support.random_checkpoints import random_tiny_checkpoint
from zoo.api import resolve
from zoo.cli import build_parser, main
from zoo.engine.generator import Generator
from zoo.loader.overlay import MANIFEST_FILE, TENSORS_FILE, OverlayError, apply_overlay, read_overlay, write_overlay
from zoo.quant.qarray import QArray
from zoo.train.fit_mtp import FitResult, _training_model, acceptance, default_prompts, save_overlay

TINY = "qwen38-tiny"                    # replaced by the random checkpoint below for every test here


@pytest.fixture(scope="module", autouse=True)
def random_tiny(tmp_path_factory):
    """The demo Qwen model's config and tokenizer with random weights: its MTP head never agrees with
    the model (the shipped one is trained and already does), so fitting has everything to gain."""
    global TINY
    TINY = str(random_tiny_checkpoint(tmp_path_factory.mktemp("random-tiny"), template=None))
    yield TINY
FIT = ["--quant", "Q8_0", "--steps", "30", "--n-prompts", "26", "--n-eval", "6", "--new-tokens", "16",
       "--lr", "3e-3", "--seed", "0"]


def mtp_params(module) -> dict:
    """The MTP parameters by dotted path: dense ones as numpy arrays, stored types (QArray) as they are."""
    out = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}
    return {k: np.asarray(v) if isinstance(v, jax.Array) else v for k, v in out.items() if k.startswith("mtp.")}


@pytest.fixture(scope="module")
def cli_fit(tmp_path_factory):
    """``zoo fit-mtp qwen38-tiny --quant Q8_0 --out D --json ...`` -> (D, its report)."""
    out = tmp_path_factory.mktemp("fit") / "overlay"
    capture = tmp_path_factory.mktemp("fit") / "stdout.json"
    with open(capture, "w") as f, contextlib.redirect_stdout(f):
        assert main(["fit-mtp", TINY, "--out", str(out), "--json", *FIT]) == 0
    return out, json.loads(capture.read_text())


def test_cli_fit_raises_greedy_acceptance(cli_fit):
    out, report = cli_fit
    before, after = report["before"], report["after"]
    print(f"qwen38-tiny Q8_0: {report['summary']}")
    assert before["rate"] < 0.05 and after["rate"] >= before["rate"] + 0.08
    assert after["by_position"][0] >= 0.12 and after["tokens_per_step"] > before["tokens_per_step"]
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    assert manifest["arch"] == "qwen38" and manifest["complete"] and manifest["fit"]["after"] == after
    assert sorted(manifest["tensors"]) == sorted(load_file(str(out / TENSORS_FILE)))
    assert "mtp.fc.weight" in manifest["tensors"] and all(k.startswith("mtp.") for k in manifest["tensors"])


def test_overlay_round_trip_is_exact(cli_fit):
    out, report = cli_fit
    base = zoo.load(TINY, quant="Q8_0")
    loaded = zoo.load(TINY, quant="Q8_0", mtp=out)
    assert loaded.load_info["mtp_overlay"]["parameters"] == len(mtp_params(base.module)) == 15
    stored = load_file(str(out / TENSORS_FILE))
    fc = mtp_params(loaded.module)["mtp.fc.kernel"]                       # was a Q8_0 QArray: now dense
    assert fc.dtype == ml_dtypes.bfloat16 and np.array_equal(fc, stored["mtp.fc.weight"].T.astype(fc.dtype))
    rest = lambda m: jax.tree.leaves(nnx.state(m.module, lambda p, _: p[0] != "mtp"))   # noqa: E731
    assert all(np.array_equal(a, b) for a, b in zip(rest(base), rest(loaded), strict=True))  # the main model
    eval_prompts = default_prompts(loaded, 6, 0, "eval")                   # the ones fit-mtp measured on
    outs = Generator(loaded, spec_tokens=2, spec_policy="fixed", prefix_cache=0).generate(eval_prompts,
                                                                                          max_new_tokens=16)
    assert acceptance(outs, 2) == report["after"]


def test_cli_generate_with_the_overlay(cli_fit, capsys):
    out, _ = cli_fit
    assert main(["generate", "--model", TINY, "--quant", "Q8_0", "--mtp", str(out), "--spec", "2",
                 "--prompt", "What is 2 + 3?", "--max-tokens", "8"]) == 0
    assert "MTP k=2: acceptance" in capsys.readouterr().err
    assert build_parser().parse_args(["serve", "--mtp", str(out)]).mtp == str(out)     # serve passes it to zoo.load
    assert main(["generate", "--mtp", str(out.parent / "missing"), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "zoo: error: MTP overlay" in err and "no such directory" in err


@pytest.fixture(scope="module")
def no_mtp_checkpoint(tmp_path_factory):
    """qwen38-tiny without its MTP tensors (and config silent on MTP)."""
    src, dst = resolve(TINY), tmp_path_factory.mktemp("no_mtp")
    for f in src.iterdir():
        if f.name != "model.safetensors":
            shutil.copy(f, dst / f.name)
    tensors = {k: v for k, v in load_file(str(src / "model.safetensors")).items() if not k.startswith("mtp.")}
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 0
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_a_model_without_mtp_gets_a_new_layer(no_mtp_checkpoint, tmp_path):
    """The path of ``fit_mtp`` for a checkpoint without an MTP layer, short of training (the acceptance
    a new layer reaches is in the ``zoo fit-mtp`` reports): the layer starts from the model's own
    last decoder layer (dequantized), its final norm and ``fc`` = [0; I]; the overlay of the whole
    layer adds it to a later load of the same quantized checkpoint."""
    model = zoo.load(no_mtp_checkpoint, quant="Q8_0")
    assert model.module.mtp is None and model.config.mtp_num_hidden_layers == 0
    train, paths, overlay, fresh = _training_model(model, ("mtp.fc.*", "mtp.block.self_attn.*"))
    assert fresh and train.config.mtp_num_hidden_layers == 1 and model.module.mtp is None
    start = {k: np.asarray(v) for k, v in mtp_params(train.module).items()}
    assert overlay == sorted(start) and set(paths) < set(overlay)              # a new layer is saved whole
    assert all(v.dtype == np.float32 for v in start.values())
    q_proj = model.module.layers[-1].self_attn.q_proj.kernel.get_value()
    assert isinstance(q_proj, QArray)
    assert np.array_equal(start["mtp.block.self_attn.q_proj.kernel"], q_proj.dequantize())
    assert np.array_equal(start["mtp.final_norm.weight"], np.asarray(model.module.norm.weight.get_value(), np.float32))
    d = model.config.hidden_size
    assert np.array_equal(start["mtp.fc.kernel"], np.concatenate([np.zeros((d, d)), np.eye(d)]))
    save_overlay(FitResult(train, train.module, overlay, True, {"summary": "not fitted"}), tmp_path / "overlay")
    loaded = zoo.load(no_mtp_checkpoint, quant="Q8_0", mtp=tmp_path / "overlay")
    assert loaded.config.mtp_num_hidden_layers == 1 and loaded.load_info["mtp_overlay"]["added_mtp_layer"]
    reloaded = mtp_params(loaded.module)
    assert reloaded.keys() == start.keys()
    assert all(np.array_equal(v.astype(ml_dtypes.bfloat16), reloaded[k]) for k, v in start.items())


def test_quantized_mtp_trains_dequantized_and_only_the_chosen_subset():
    model = zoo.load(TINY, quant="Q8_0", dtype="float32")
    assert isinstance(model.module.mtp.fc.kernel.get_value(), QArray)
    train, paths, overlay, fresh = _training_model(model, ("mtp.fc.*", "mtp.*norm*"))
    assert not fresh and overlay == sorted(paths) and "mtp.fc.kernel" in paths
    params = {".".join(map(str, p)): v.get_value() for p, v in nnx.to_flat_state(nnx.state(train.module, nnx.Param))}
    assert all(params[p].dtype == np.float32 and not isinstance(params[p], QArray) for p in paths)
    assert np.array_equal(params["mtp.fc.kernel"], model.module.mtp.fc.kernel.get_value().dequantize())
    assert isinstance(params["mtp.block.mlp.up_proj.kernel"], QArray)     # frozen as loaded
    with pytest.raises(ValueError, match="MTP parameters only"):
        _training_model(model, ("mtp.*", "norm.*"))


@pytest.fixture(scope="module")
def small_overlay(tmp_path_factory):
    """A valid overlay of qwen38-tiny's own MTP tensors (no fitting): (dir, tensors, params, model)."""
    from zoo.models.architectures import architecture

    model = zoo.load(TINY, dtype="float32")
    tensors = {k: v.astype(np.float32) for k, v in load_file(str(resolve(TINY) / "model.safetensors")).items()
               if k.startswith("mtp.")}
    name_map = architecture("qwen38").hf_name_map(model.config)
    params = {k: name_map.resolve(k).path for k in tensors}
    out = tmp_path_factory.mktemp("overlay") / "good"
    write_overlay(out, tensors, params, model.config, complete=True, base={}, fit={})
    return out, tensors, params, model


def _rewrite(dst, small_overlay, tensors=None, complete=True):
    _, good, params, model = small_overlay
    tensors = good if tensors is None else tensors
    params = {**params, **{k: "?" for k in tensors if k not in params}}
    write_overlay(dst, tensors, params, model.config, complete=complete, base={}, fit={})
    return dst


def test_overlay_errors_are_clear_and_apply_nothing(small_overlay, no_mtp_checkpoint, tmp_path):
    good, tensors, _, model = small_overlay
    before = mtp_params(model.module)
    applied, _, _ = apply_overlay(model.module, model.config, read_overlay(good))
    assert all(np.array_equal(v, mtp_params(applied)[k]) for k, v in before.items())   # the same tensors

    def fails(path, match, target=model):
        with pytest.raises(OverlayError, match=match):
            apply_overlay(target.module, target.config, read_overlay(path))
        assert all(np.array_equal(v, mtp_params(model.module)[k]) for k, v in before.items())

    with pytest.raises(OverlayError, match="no such directory"):
        zoo.load(TINY, mtp=tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    fails(tmp_path / "empty", "no mtp_overlay.json")
    corrupt = shutil.copytree(good, tmp_path / "truncated")
    data = (corrupt / TENSORS_FILE).read_bytes()
    (corrupt / TENSORS_FILE).write_bytes(data[:len(data) - 100])
    fails(corrupt, "corrupt MTP overlay: .*corrupt offsets")
    flipped = shutil.copytree(good, tmp_path / "flipped")
    (flipped / TENSORS_FILE).write_bytes(data[:-8] + bytes(8 * [0x55]))
    fails(flipped, r"is corrupt \(CRC-32")
    bad_json = shutil.copytree(good, tmp_path / "bad_json")
    (bad_json / MANIFEST_FILE).write_text("{not json")
    fails(bad_json, "corrupt overlay manifest")
    (bad_json / MANIFEST_FILE).write_text('{"format": 1, "arch": "qwen38", "tensors": []}')
    fails(bad_json, "not an MTP overlay manifest .*config, tensors, complete")

    glm = zoo.load("glm53-tiny", dtype="float32")
    fails(good, "fitted for architecture 'qwen38'; this model is 'glm53'", glm)
    q256 = zoo.load(DATA / "qwen38-q256-udmix.gguf", dtype="float32")
    fails(good, "fitted for hidden_size=128; this model has hidden_size=256", q256)
    wide = dict(tensors, **{"mtp.fc.weight": np.zeros((128, 320), np.float32)})
    fails(_rewrite(tmp_path / "shape", small_overlay, wide), r"mtp.fc.weight.*\(128, 320\).*\(256, 128\)")
    extra = dict(tensors, **{"model.norm.weight": np.zeros(128, np.float32)})
    fails(_rewrite(tmp_path / "extra", small_overlay, extra), "'model.norm.weight' is not an MTP tensor")
    short = {k: v for k, v in tensors.items() if k != "mtp.layers.0.mlp.up_proj.weight"}
    fails(_rewrite(tmp_path / "short", small_overlay, short), r"missing MTP tensor\(s\) for parameter\(s\) "
          r"\['mtp.block.mlp.up_proj.kernel'\]")
    lost = _rewrite(tmp_path / "lost", small_overlay)
    save_file({k: v for k, v in tensors.items() if k != "mtp.norm.weight"}, str(lost / TENSORS_FILE))
    fails(lost, r"missing MTP tensor\(s\) \['mtp.norm.weight'\] that mtp_overlay.json lists")
    partial = _rewrite(tmp_path / "partial", small_overlay, short, complete=False)
    applied, _, _ = apply_overlay(model.module, model.config, read_overlay(partial))   # a subset replaces a subset
    assert np.array_equal(mtp_params(applied)["mtp.block.mlp.up_proj.kernel"], before["mtp.block.mlp.up_proj.kernel"])
    no_mtp = zoo.load(no_mtp_checkpoint, dtype="float32")
    fails(partial, "no MTP layer and MTP overlay .* holds only part of one", no_mtp)


@pytest.mark.parametrize("name", ["qwen38-tiny", "glm53-tiny"])
def test_names_from_the_rules_match_the_checkpoint(name):
    """``export_tensors`` without a template names every parameter by the name map run backwards: the
    checkpoint's own names (less the stripped prefix) and tensors, experts one tensor each."""
    from zoo.models.architectures import architecture
    from zoo.sources.safetensors import SafetensorsSource
    from zoo.train.export import export_tensors

    model = zoo.load(name, dtype="float32")
    name_map = architecture(model.config.arch).hf_name_map(model.config)
    source = SafetensorsSource(resolve(name))
    by_rules = export_tensors(model.module, name_map, dtype="bfloat16")
    stripped = {k.removeprefix("model.language_model.").removeprefix("model."): k for k in source.keys()}
    assert set(by_rules) == set(stripped)
    assert all(np.array_equal(v, source.read(stripped[k])) for k, v in by_rules.items())


def test_teacher_targets():
    """``mtp_teacher``: argmax targets at temperature 0, soft cross-entropy at T > 0, hits = agreement."""
    import jax.numpy as jnp

    from zoo.train.loss import teacher_stats, token_stats
    rng = np.random.default_rng(0)
    logits, teacher = (jnp.asarray(rng.standard_normal((2, 5, 11)), jnp.float32) for _ in range(2))
    weights = jnp.asarray(rng.integers(0, 2, (2, 5)))
    hard = teacher_stats(logits, teacher, weights, 0.0)
    assert hard == token_stats(logits, jnp.argmax(teacher, -1), weights)
    soft = teacher_stats(logits, teacher, weights, 2.0)
    p, logq = jax.nn.softmax(teacher / 2.0, -1), jax.nn.log_softmax(logits, -1)
    assert np.isclose(soft.nll, -jnp.sum(jnp.sum(p * logq, -1) * weights), rtol=1e-6)
    assert soft.correct == hard.correct and soft.count == hard.count == weights.sum()
