"""Comparing an abstract load (``zoo.load(..., weights=False)``) with a real one, leaf by leaf."""

from __future__ import annotations

import jax
from flax import nnx


def leaves(model) -> dict[str, list[tuple]]:
    """``{parameter: [(stored type, tree structure, leaf shape, leaf dtype, leaf sharding spec)]}``."""
    out = {}
    for path, var in nnx.to_flat_state(nnx.state(model.module)):
        value = var.get_value()
        structure = str(jax.tree.structure(value))
        kind = "dense" if structure == "PyTreeDef(*)" else type(value).__name__      # an array or its shape
        out[".".join(map(str, path))] = [(kind, structure, tuple(x.shape), str(x.dtype), _spec(x))
                                         for x in jax.tree.leaves(value)]
    return out


def _spec(x) -> tuple | None:
    sharding = getattr(x, "sharding", None)
    return tuple(sharding.spec) if hasattr(sharding, "spec") else None


def differences(abstract, real, shardings: bool) -> list[str]:
    """Parameters whose abstract and real leaves differ (kinds, shapes, dtypes; shardings if asked)."""
    a, r = leaves(abstract), leaves(real)
    if a.keys() != r.keys():
        return [f"parameters differ: {sorted(set(a) ^ set(r))[:5]}"]
    cut = 5 if shardings else 4
    return [f"{k}: abstract {[x[:cut] for x in a[k]]} real {[x[:cut] for x in r[k]]}"
            for k in a if [x[:cut] for x in a[k]] != [x[:cut] for x in r[k]]]
