"""``zoo eval`` on the tiny q256 models: the float32 reference (each fixture's tensors dequantized by
gguf, written as F32) against the quantized fixture itself and against a Q4_0 copy from gguf's
quantizer; every figure equals a direct numpy computation from the two models' logits (the KL
divergence within the stated bound of its 16-bit storage), through the Python API and the CLI, with
clear errors for inputs that do not match."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

import zoo
import zoo.eval
from tests.support.gguf_files import write_requantized
from tests.support.paths import DATA
from zoo.cli import main as zoo_main
from zoo.engine.compile_cache import CompileCounter
from zoo.engine.step_programs import forget_shared
from zoo.formats.ggml import QType

CTX, WINDOWS = 64, 3
FIXTURES = {"qwen": "qwen38-q256-udmix.gguf", "glm": "glm53-q256-udmix.gguf"}


@pytest.fixture(scope="module", params=sorted(FIXTURES))
def family(request, tmp_path_factory):
    """The family's reference (float32) and candidates (the fixture, a Q4_0 copy), loaded, with the
    evaluation tokens and pass 1 written for them."""
    tmp = tmp_path_factory.mktemp(f"eval-{request.param}")
    fixture = DATA / FIXTURES[request.param]
    ref_path = write_requantized(fixture, tmp / "ref-f32.gguf", lambda name, info: QType.F32)
    q4_path = write_requantized(fixture, tmp / "q4_0.gguf",
                                lambda name, info: QType.Q4_0 if info.quantized else QType.F32)
    ref = zoo.load(ref_path, dtype="float32")
    tokens = np.random.default_rng(7).integers(0, ref.config.vocab_size, CTX * WINDOWS + 5)
    base = zoo.eval.base(ref, tmp / "base.npz", tokens=tokens, ctx=CTX, progress=False)
    return {"tmp": tmp, "ref": ref, "ref_path": ref_path, "tokens": tokens, "base": base,
            "candidates": {"fixture": zoo.load(fixture, dtype="float32"), "q4_0": zoo.load(q4_path, dtype="float32")},
            "q4_path": q4_path}


def direct(ref, cand, windows) -> dict:
    """The per-token values from the two models' logits, window by window, in float64."""
    first, scored = CTX // 2, CTX - 1 - CTX // 2
    out = {k: [] for k in ("kld", "base_nll", "cand_nll", "same_top", "dp_top", "dp_next")}
    for w in windows:
        lp, lq = (np.asarray(m.logits(w[None])[0, first:first + scored], np.float64) for m in (ref, cand))
        lp, lq = (x - x.max(-1, keepdims=True) for x in (lp, lq))
        lp, lq = (x - np.log(np.exp(x).sum(-1, keepdims=True)) for x in (lp, lq))
        nxt, rows = w[first + 1:first + 1 + scored], np.arange(scored)
        top = lp.argmax(-1)
        out["kld"].append((np.exp(lp) * (lp - lq)).sum(-1))
        out["base_nll"].append(-lp[rows, nxt])
        out["cand_nll"].append(-lq[rows, nxt])
        out["same_top"].append(lq.argmax(-1) == top)
        out["dp_top"].append(np.exp(lq[rows, top]) - np.exp(lp[rows, top]))
        out["dp_next"].append(np.exp(lq[rows, nxt]) - np.exp(lp[rows, nxt]))
    return {k: np.concatenate(v) for k, v in out.items()}


@pytest.mark.parametrize("candidate", ["fixture", "q4_0"])
def test_figures_equal_a_direct_computation(family, candidate):
    ref, cand = family["ref"], family["candidates"][candidate]
    report = zoo.eval.kld(cand, family["base"], tokens=family["tokens"], progress=False)
    want = direct(ref, cand, family["tokens"][:CTX * WINDOWS].reshape(WINDOWS, CTX))
    got = report.per_token
    n = WINDOWS * (CTX - 1 - CTX // 2)
    assert report.figures["tokens"] == n == len(got["kld"])
    for key in ("base_nll", "cand_nll", "dp_top", "dp_next"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-9, atol=1e-12, err_msg=key)
    np.testing.assert_array_equal(got["same_top"], want["same_top"])
    # the KL divergence from the 16-bit reference: within its bound of the exact value, every token
    assert np.all(np.abs(got["kld"] - want["kld"]) <= got["kld_bound"] + 1e-12)
    assert got["kld_bound"].max() < 1e-3
    f = report.figures
    assert f["ppl_base"]["mean"] == pytest.approx(math.exp(want["base_nll"].mean()), rel=1e-9)
    assert f["ppl_cand"]["mean"] == pytest.approx(math.exp(want["cand_nll"].mean()), rel=1e-9)
    assert f["ppl_ratio"]["mean"] == pytest.approx(math.exp((want["cand_nll"] - want["base_nll"]).mean()), rel=1e-9)
    assert f["top1"]["mean"] == pytest.approx(want["same_top"].mean())
    assert abs(f["kld"]["mean"] - want["kld"].mean()) <= f["kld_bound_mean"]
    assert f["kld"]["p99"] == pytest.approx(np.percentile(got["kld"], 99))
    if candidate == "q4_0":                      # a real quantization error, measured as such
        assert f["kld"]["mean"] > 1e-3 and f["top1"]["mean"] < 1
    else:                                        # the same dequantized values: only rounding differs
        assert f["kld"]["mean"] < 1e-4


def test_a_batched_pass_needs_the_programs_of_one_forward_and_gives_the_same_figures(family):
    def fresh():                                              # a model whose programs are not yet traced
        forget_shared()                                       # (equal models share them in a process)
        return zoo.load(family["q4_path"], dtype="float32")

    fresh().logits(np.zeros((2, CTX), np.int32))              # the process-wide small programs, once
    with CompileCounter() as one_forward:
        fresh().logits(np.zeros((2, CTX), np.int32))
    with CompileCounter() as counter:
        report = zoo.eval.kld(fresh(), family["base"], batch=2, progress=False)   # 3 windows: the last batch padded
    assert counter.programs == one_forward.programs > 0
    one = zoo.eval.kld(family["candidates"]["q4_0"], family["base"], progress=False)
    for key in ("kld", "cand_nll", "dp_top"):
        np.testing.assert_allclose(report.per_token[key], one.per_token[key], rtol=1e-5, atol=1e-7)


def test_the_cli_runs_both_passes(family, capsys):
    tmp = family["tmp"]
    np.save(tmp / "tokens.npy", family["tokens"])
    out = tmp / "cli-base.npz"
    assert zoo_main(["eval", "base", str(family["ref_path"]), "--dtype", "float32", "--tokens",
                     str(tmp / "tokens.npy"), "--out", str(out), "--ctx", str(CTX), "--chunks", "2",
                     "--quiet"]) == 0
    assert zoo.eval.BaseFile(out).meta["windows"] == 2
    capsys.readouterr()
    assert zoo_main(["eval", "kld", str(family["q4_path"]), "--dtype", "float32", "--base", str(out), "--json",
                     "--quiet", "--per-token", str(tmp / "per-token.npz")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["figures"]["tokens"] == 2 * (CTX - 1 - CTX // 2)
    assert report["reference"]["windows"] == 2 and report["candidate"]["model"].endswith("q4_0.gguf")
    assert set(np.load(tmp / "per-token.npz").files) >= {"kld", "same_top", "cand_nll"}
    assert zoo_main(["eval", "kld", str(family["q4_path"]), "--dtype", "float32", "--base", str(out),
                     "--quiet"]) == 0
    text = capsys.readouterr().out
    for line in ("Mean PPL(Q)", "Mean PPL(Q)/PPL(base)", "Mean    KLD:", "99.0%   KLD:", "Same top p:"):
        assert line in text


@pytest.mark.parametrize("family", ["qwen"], indirect=True)     # its base file, scored by the GLM model too
def test_inputs_that_do_not_match_are_refused(family, tmp_path, capsys):
    glm = zoo.load(DATA / FIXTURES["glm"], dtype="float32")
    with pytest.raises(ValueError, match="tokenizer differs from the reference's"):
        zoo.eval.kld(glm, family["base"], progress=False)
    other = family["tokens"].copy()
    other[CTX + 3] = (other[CTX + 3] + 1) % 512
    with pytest.raises(ValueError, match="window 1, position 3 is token"):
        zoo.eval.kld(family["candidates"]["q4_0"], family["base"], tokens=other, progress=False)
    with pytest.raises(ValueError, match="cuts into 1 windows"):
        zoo.eval.kld(family["candidates"]["q4_0"], family["base"], tokens=other[:CTX + 1], progress=False)
    with pytest.raises(ValueError, match="outside the model's vocabulary of 512"):
        zoo.eval.base(family["ref"], tmp_path / "x.npz", tokens=np.full(CTX, 600), ctx=CTX, progress=False)
    with pytest.raises(ValueError, match="exactly one of text=, tokens="):
        zoo.eval.base(family["ref"], tmp_path / "x.npz", ctx=CTX, progress=False)
    assert not list(tmp_path.iterdir())                       # nothing written by a refused pass
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not a zip")
    assert zoo_main(["eval", "kld", str(family["q4_path"]), "--base", str(bad), "--quiet"]) == 2
    assert "is not a reference file written by `zoo eval base`" in capsys.readouterr().err
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(family["base"].read_bytes()[:-4000])
    with pytest.raises(ValueError, match="is not a reference file"):
        zoo.eval.BaseFile(truncated)
    assert zoo_main(["eval", "kld", str(family["q4_path"]), "--base", str(tmp_path / "none.npz")]) == 2
    assert "no reference file" in capsys.readouterr().err


def test_an_interrupted_pass_leaves_nothing_behind(family, tmp_path):
    class Failing:
        """The reference model, failing at its second forward pass."""
        def __init__(self, model):
            self.model, self.calls = model, 0
            self.config, self.tokenizer, self.load_info = model.config, model.tokenizer, model.load_info

        def logits(self, ids):
            self.calls += 1
            if self.calls == 2:
                raise RuntimeError("device lost")
            return self.model.logits(ids)

    with pytest.raises(RuntimeError, match="device lost"):
        zoo.eval.base(Failing(family["ref"]), tmp_path / "base.npz", tokens=family["tokens"], ctx=CTX,
                      progress=False)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("family", ["qwen"], indirect=True)
def test_text_is_tokenized_with_the_models_tokenizer(family, tmp_path):
    text = "the quick brown fox jumps over the lazy dog. " * 40
    ids = family["ref"].tokenizer.encode(text)
    path = zoo.eval.base(family["ref"], tmp_path / "b.npz", text=text, ctx=CTX, progress=False)
    base = zoo.eval.BaseFile(path)
    np.testing.assert_array_equal(base.windows.ravel(), ids[:base.windows.size])
    report = zoo.eval.kld(family["candidates"]["q4_0"], path, text=text, progress=False)
    assert report.figures["tokens"] == base.windows.shape[0] * (CTX - 1 - CTX // 2)


@pytest.mark.parametrize("family", ["qwen"], indirect=True)
def test_pass_two_on_a_mesh_of_eight_devices_gives_the_same_figures(family):
    flags = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-m", "zoo", "eval", "kld", str(family["q4_path"]), "--dtype", "float32",
                           "--mesh", "tp", "--base", str(family["base"]), "--batch", "2", "--json", "--quiet"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    on_mesh = json.loads(done.stdout)["figures"]
    one = zoo.eval.kld(family["candidates"]["q4_0"], family["base"], progress=False).figures
    for key in ("kld", "ppl_cand", "ppl_ratio"):
        assert on_mesh[key]["mean"] == pytest.approx(one[key]["mean"], rel=1e-5), key
    assert on_mesh["top1"]["mean"] == pytest.approx(one["top1"]["mean"], abs=2 / one["tokens"])
