"""Cache mesh independence on 8 virtual CPU devices, run in its own process by
``tests/test_checkpoint_mesh.py`` (the device count must be set before jax is imported)::

    python -m tests.support.checkpoint_mesh_checks '{"gguf": ..., "cache": ...}'

Saves the quantized GLM fixture's cache on one device and restores it in the tensor-parallel
layout; saves on "tp" and restores on "ep". Every restored leaf must carry the sharding its logical
axes give on the target mesh, hold the same values as the fresh load, and give the same logits.
Prints one JSON line of measurements.
"""

from __future__ import annotations

import json
import sys

import jax
import numpy as np
from flax import nnx

import zoo
from tests.support.helpers import rel_err
from zoo.sharding.mesh import state_shardings


def leaves(model) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model.module))]


def check(saved_on, restored_on, gguf: str, cache: str, ids: np.ndarray, reference: np.ndarray) -> float:
    fresh = zoo.load(gguf, dtype="float32", mesh=saved_on, cache=cache)
    assert fresh.load_info["source"] == "source", fresh.load_info
    restored = zoo.load(gguf, dtype="float32", mesh=restored_on, cache=cache)
    assert restored.load_info["source"] == "cache", restored.load_info
    if restored.mesh is not None:
        want = state_shardings(restored.module, restored.mesh)
        for path, var in nnx.to_flat_state(nnx.state(restored.module)):
            got = [leaf.sharding for leaf in jax.tree.leaves(var.get_value())]
            assert got == want[".".join(map(str, path))], path
    assert all(np.array_equal(a, b) for a, b in zip(leaves(fresh), leaves(restored)))
    return rel_err(restored.logits(ids), reference)


def main(args: dict) -> None:
    assert len(jax.devices()) == 8, jax.devices()
    ids = np.load(args["ids"])[:, :24]
    reference = zoo.load(args["gguf"], dtype="float32").logits(ids)
    errs = {"1dev_to_tp": check(None, "tp", args["gguf"], args["cache"] + "/a", ids, reference),
            "tp_to_ep": check("tp", "ep", args["gguf"], args["cache"] + "/b", ids, reference)}
    assert max(errs.values()) <= 1e-5, errs
    print(json.dumps(errs))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
