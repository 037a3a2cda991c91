"""Which parameters a training run updates: globs over dotted parameter paths.

A parameter's path is its place in the module, dotted: ``embed_tokens.embedding``,
``layers.3.mlp.gate_proj.kernel``, ``mtp.fc.kernel`` (the names ``zoo.load`` fills and
``nnx.to_flat_state`` lists). ``trainable`` is None (every parameter), one glob or a sequence of
globs (``fnmatch``: ``*`` crosses dots), e.g. ``"mtp.*"`` to fit the MTP head alone::

    graphdef, params, frozen = split_trainable(module, "mtp.*")
    module = nnx.merge(graphdef, params, frozen)
"""

from __future__ import annotations

import fnmatch
from typing import Sequence

from flax import nnx

Trainable = str | Sequence[str] | None


def dotted(path) -> str:
    return ".".join(map(str, path))


def path_filter(trainable: Trainable):
    """An NNX filter ``(path, value) -> bool``: a parameter whose dotted path matches a glob."""
    if trainable is None:
        return nnx.Param
    globs = (trainable,) if isinstance(trainable, str) else tuple(trainable)

    def keep(path, value) -> bool:
        name = dotted(path)
        return isinstance(value, nnx.Param) and any(fnmatch.fnmatchcase(name, g) for g in globs)
    return keep


def split_trainable(module: nnx.Module, trainable: Trainable = None):
    """``(graphdef, trainable state, frozen state)`` of ``module``; ValueError if nothing matches."""
    graphdef, params, frozen = nnx.split(module, path_filter(trainable), ...)
    if not nnx.to_flat_state(params):
        raise ValueError(f"no parameter path matches {trainable!r} (e.g. {_examples(module)})")
    return graphdef, params, frozen


def _examples(module: nnx.Module) -> str:
    paths = [dotted(p) for p, _ in nnx.to_flat_state(nnx.state(module))]
    return ", ".join(paths[:3] + paths[-2:])
