"""The losses against the model's public forward, and exact gradient accumulation (Qwen3.8 tiny).

- ``zoo.train.loss`` on a batch with left padding, right padding and a partial loss mask equals a
  numpy cross-entropy over ``Model.logits`` / ``Model.mtp_logits`` (row t of the MTP: h_t, x_{t+1}
  -> x_{t+2}) at the targets the masks select.
- Two micro-batches whose targets are split 3 : 1 give the gradient (Adam's first moment after one
  step is 0.1 g) and the update of one step on the whole batch.
"""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

import zoo
from tests.support.helpers import rel_err
from zoo.train.step import Batch, Trainer

ROWS, LENGTH = 4, 32            # the shape of tests/train/test_training.py's batch: its step program is reused


@pytest.fixture(scope="module")
def model():
    return zoo.load("qwen38-tiny", dtype="float32")


def uneven_batch() -> Batch:
    """Row 0: every token a target; row 1: left padding; row 2: right padding; row 3: three targets."""
    rng = np.random.default_rng(7)
    ids = rng.integers(20, 500, size=(ROWS, LENGTH))
    mask = np.ones(ids.shape, bool)
    mask[1, :6] = False
    mask[2, -9:] = False
    loss_mask = mask.copy()
    loss_mask[1, 6:12] = False           # a prompt
    loss_mask[3, :-3] = False
    return Batch(ids, loss_mask, mask)


def numpy_stats(logits: np.ndarray, targets: np.ndarray, weights: np.ndarray) -> tuple[float, float]:
    logits = logits.astype(np.float64)
    logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
    nll = logz - np.take_along_axis(logits, targets[..., None], -1)[..., 0]
    return float((nll * weights).sum() / weights.sum()), float(((logits.argmax(-1) == targets) * weights).sum())


def test_losses_match_the_models_logits_and_mtp_logits(model):
    batch = uneven_batch()
    ids, loss_mask, mask = batch
    trainer = Trainer(model, optax.sgd(0.0))
    metrics = {k: float(v) for k, v in trainer.evaluate(trainer.init(), batch).items()}
    for name, logits, shift in (("lm", model.logits(ids, mask), 1), ("mtp", model.mtp_logits(ids, mask), 2)):
        weights = loss_mask[:, shift:] & mask[:, shift:] & mask[:, :-shift] & mask[:, 1:LENGTH + 1 - shift]
        mean, hits = numpy_stats(logits[:, :LENGTH - shift], ids[:, shift:], weights)
        print(f"{name}: loss {metrics[name + '_loss']:.6f} (numpy {mean:.6f}) over {weights.sum()} targets")
        assert metrics[name + "_targets"] == weights.sum()
        assert abs(metrics[name + "_accuracy"] * weights.sum() - hits) < 1e-3
        assert abs(metrics[name + "_loss"] - mean) <= 1e-5 * mean


def test_two_micro_batches_give_the_whole_batch_update(model):
    batch = uneven_batch()
    halves = [batch.loss_mask[:2, 1:].sum(), batch.loss_mask[2:, 1:].sum()]
    assert halves[0] > 2 * halves[1]         # a mean of the halves' means would weigh targets unequally
    runs = {}
    for micro in (1, 2):
        trainer = Trainer(model, optax.adam(3e-3), mtp_weight=1.0, micro_batches=micro)
        start = trainer.init()
        before = [np.asarray(x) for x in jax.tree.leaves(start.params)]
        state, metrics = trainer.step(start, batch)
        grads = [np.asarray(x) / 0.1 for x in jax.tree.leaves(state.opt_state[0].mu)]     # mu = (1 - b1) g
        updates = [np.asarray(x) - b for x, b in zip(jax.tree.leaves(state.params), before)]
        runs[micro] = grads, updates, {k: float(v) for k, v in metrics.items()}
    (g1, u1, m1), (g2, u2, m2) = runs[1], runs[2]
    grad_err = max(rel_err(a, b) for a, b in zip(g2, g1))
    # Adam's first update is lr * g / (|g| + eps): compared where g is above the noise of the sums' order
    big = [np.abs(g) > 1e-3 * np.abs(g).max() for g in g1]
    update_err = max(rel_err(a[m], b[m]) for a, b, m in zip(u2, u1, big))
    print(f"micro-batches 2 vs 1: gradient rel err {grad_err:.1e}, update rel err {update_err:.1e}, "
          f"loss {m2['loss']:.6f} vs {m1['loss']:.6f}")
    assert grad_err <= 1e-4 and update_err <= 1e-3
    assert m1.keys() == m2.keys() and all(abs(m2[k] - m1[k]) <= 1e-5 * max(1.0, abs(m1[k])) for k in m1)
