"""EleutherAI's lm-evaluation-harness pointed at a real ``zoo serve`` (the embedded tiny model on
127.0.0.1): its ``local-completions`` model scores a tiny local multiple-choice task
(``tests/data/lm_eval/``, nothing downloaded) through ``/v1/completions`` with ``echo``, ``logprobs: 1``
and token-id prompts, batched. Every log-likelihood lm-eval reports equals a direct float32
log-softmax of ``Model.logits`` summed over the continuation's tokens, and its accuracies are the
ones those direct numbers imply."""

from __future__ import annotations

import signal

import numpy as np
import pytest

import zoo
from tests.support.cli_serve import start_zoo_serve
from tests.support.paths import DATA, ROOT
from zoo.registry import embedded_path

KEY = "lm-eval-key"
TASK = "zoo_tiny_mc"
TOL = 1e-4          # summed over a continuation's tokens; each token agrees to ~1e-5 in float32


@pytest.fixture(scope="module")
def server():
    """``zoo serve`` in float32 (so lm-eval's numbers can be compared tightly with ``Model.logits``)."""
    proc, printed = start_zoo_serve("--port", "0", "--log-level", "warning", "--dtype", "float32",
                                    "--context", "512", "--prefill-chunk", "64", "--max-batch", "4",
                                    env={"ZOO_API_KEY": KEY})
    try:
        yield printed
    finally:
        proc.send_signal(signal.SIGINT)
        proc.stdout.close()
        assert proc.wait(30) == 0


@pytest.fixture(scope="module")
def evaluated(server, tmp_path_factory):
    """lm-eval's ``simple_evaluate`` on the task, as ``lm_eval --model local-completions ...`` runs
    it: the key from ``OPENAI_API_KEY``, the tokenizer from the embedded checkpoint (it tokenizes
    and sends token ids), four prompts per request, two requests in flight."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OPENAI_API_KEY", KEY)
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf-datasets")))
        mp.chdir(ROOT)                       # the task's data_files path is relative to the repository
        from lm_eval import simple_evaluate
        from lm_eval.tasks import TaskManager

        return simple_evaluate(
            model="local-completions",
            model_args={"base_url": server["OpenAI base URL"] + "/completions", "model": "qwen38-tiny",
                        "tokenizer_backend": "huggingface",
                        "tokenizer": str(embedded_path("qwen38-tiny")),
                        "num_concurrent": 2, "max_length": 512},
            tasks=[TASK], task_manager=TaskManager(include_path=str(DATA / "lm_eval"), include_defaults=False),
            batch_size=4, log_samples=True, bootstrap_iters=0)


def direct_loglikelihoods(pairs: list[tuple[str, str]]) -> list[tuple[float, bool]]:
    """(sum of the continuation tokens' log-probabilities, whether each is the argmax) per
    (context, continuation), from one float32 forward of the whole batch, left-padded; the
    continuation's tokens are those of context + continuation after the context's (as lm-eval splits)."""
    model = zoo.load("qwen38-tiny", dtype="float32")
    tok = model.tokenizer
    seqs, starts = [], []
    for ctx, cont in pairs:
        whole, head = tok.encode(ctx + cont), tok.encode(ctx)
        assert whole[:len(head)] == head and len(whole) > len(head)
        seqs.append(whole)
        starts.append(len(head))
    width = max(map(len, seqs))
    ids = np.zeros((len(seqs), width), np.int32)
    mask = np.zeros((len(seqs), width), bool)
    for row, seq in enumerate(seqs):
        ids[row, width - len(seq):], mask[row, width - len(seq):] = seq, True
    x = model.logits(ids, mask).astype(np.float64)
    logp = x - x.max(-1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
    out = []
    for row, (seq, start) in enumerate(zip(seqs, starts)):
        at = width - len(seq) + np.arange(start, len(seq))             # positions of the continuation
        rows = logp[row, at - 1]                                         # each predicted from the one before
        out.append((float(rows[np.arange(len(at)), np.asarray(seq)[start:]].sum()),
                    bool((rows.argmax(-1) == np.asarray(seq)[start:]).all())))
    return out


@pytest.fixture(scope="module")
def samples(evaluated):
    """lm-eval's samples in document order, each with the direct (log-likelihood, greedy) of its
    choices beside lm-eval's own."""
    docs = sorted(evaluated["samples"][TASK], key=lambda s: s["doc_id"])
    pairs = [tuple(args) for s in docs for args in s["arguments"]]
    direct = iter(direct_loglikelihoods(pairs))
    return [{**s, "direct": [next(direct) for _ in s["arguments"]]} for s in docs]


def test_every_loglikelihood_is_the_models(samples):
    assert len(samples) == 8
    for s in samples:
        doc = s["doc"]
        assert [tuple(a) for a in s["arguments"]] == [(doc["question"], " " + c) for c in doc["choices"]]
        got = [(float(ll), bool(greedy)) for ll, greedy in s["filtered_resps"]]
        want = s["direct"]
        np.testing.assert_allclose([g[0] for g in got], [w[0] for w in want], rtol=0, atol=TOL,
                                   err_msg=doc["question"])
        assert [g[1] for g in got] == [w[1] for w in want], doc["question"]


def test_accuracy_is_what_the_direct_loglikelihoods_imply(evaluated, samples):
    acc, acc_norm = [], []
    for s in samples:
        doc = s["doc"]
        lls = np.array([ll for ll, _ in s["direct"]])
        normed = lls / [len(c) for c in doc["choices"]]          # lm-eval's acc_norm: per character
        for scores in (lls, normed):
            top2 = np.sort(scores)[-2:]
            assert top2[1] - top2[0] > 100 * TOL, doc            # no near-tie: no argmax flips within TOL
        acc.append(float(lls.argmax() == doc["answer"]))
        acc_norm.append(float(normed.argmax() == doc["answer"]))
        assert (s["acc"], s["acc_norm"]) == (acc[-1], acc_norm[-1]), doc
    result = evaluated["results"][TASK]
    assert result["acc,none"] == pytest.approx(np.mean(acc))
    assert result["acc_norm,none"] == pytest.approx(np.mean(acc_norm))
    assert 0 < np.mean(acc) < 1            # some right, some wrong: a mix-up of choices or documents would show
