"""One training step on a ``Mesh`` of 8 virtual CPU devices against the same step on one device,
run in its own process by ``tests/train/test_sharded_step.py`` (``XLA_FLAGS`` must give 8 devices
before jax is imported)::

    python -m tests.train.sharded_check '{"path": CHECKPOINT, "ckpt": DIR}'

Prints one JSON line: the largest relative errors of the metrics, the gradients (the momentum
trace after one step) and the new parameters, how many parameters stay split over the mesh, and whether an Orbax
round trip of the sharded state is exact and keeps its shardings.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
import optax

import zoo
from tests.support.helpers import rel_err
from zoo.sharding.mesh import make_mesh
from zoo.train import checkpoint
from zoo.train.step import Batch, Trainer


def one_step(model, batch):
    trainer = Trainer(model, optax.sgd(0.1, momentum=0.9), mtp_weight=0.5, micro_batches=2)
    state, metrics = trainer.step(trainer.init(), batch)
    return trainer, state, {k: float(v) for k, v in metrics.items()}


def main(path: str, ckpt: str) -> dict:
    rng = np.random.default_rng(3)
    ids = rng.integers(1, 256, size=(4, 16))
    loss_mask = np.ones(ids.shape, bool)
    loss_mask[:, :5] = False
    batch = Batch(ids, loss_mask)
    mesh = make_mesh("tp")
    _, single, m1 = one_step(zoo.load(path, dtype="float32"), batch)
    trainer, sharded, m8 = one_step(zoo.load(path, dtype="float32", mesh=mesh), batch)
    leaves = lambda s: [np.asarray(x) for x in jax.tree.leaves(s)]         # noqa: E731
    split = [x for x in jax.tree.leaves(sharded.params) if not x.sharding.is_fully_replicated]
    trace_split = [x for x in jax.tree.leaves(sharded.opt_state[0].trace) if not x.sharding.is_fully_replicated]
    restored = checkpoint.restore(checkpoint.save(ckpt, sharded), trainer.abstract_state())
    same = all(np.array_equal(a, b) and a.sharding == b.sharding
               for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(restored)))
    return {"metrics_err": max(abs(m8[k] - m1[k]) / max(1.0, abs(m1[k])) for k in m1),
            "grad_err": max(rel_err(a, b) for a, b in zip(leaves(sharded.opt_state[0].trace),
                                                          leaves(single.opt_state[0].trace))),
            "params_err": max(rel_err(a, b) for a, b in zip(leaves(sharded.params), leaves(single.params))),
            "split_params": len(split), "split_traces": len(trace_split), "restored_exact": same,
            "loss": m8["loss"]}


if __name__ == "__main__":
    assert jax.device_count() == 8, f"expected 8 virtual devices, got {jax.device_count()} (XLA_FLAGS)"
    print(json.dumps(main(**json.loads(sys.argv[1]))))
