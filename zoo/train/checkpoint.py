"""Save and restore a ``TrainState`` (trainable parameters, optimizer state, step) with Orbax.

    save(path, state)              one Orbax checkpoint directory (an earlier checkpoint there is
                                   replaced; any other non-empty directory is refused)
    restore(path, like) -> state   ``like``: ``trainer.abstract_state()`` (ShapeDtypeStructs with
                                   their shardings, nothing allocated) or a TrainState of the same
                                   run: shapes, dtypes, tree structure and placement come from it
                                   (Orbax reshards: a state saved on one mesh may restore onto another)
    latest(root) -> path | None    the newest ``step_N`` directory under ``root`` (``save_step``)

The parameters are stored as plain nested dicts (``nnx.to_pure_dict``): the checkpoint is a
tree of arrays keyed by parameter path, readable without the model code. Frozen parameters are not
saved (they are the model's own); ``zoo.train.export`` writes a whole model back to a checkpoint
directory that ``zoo.load`` reads.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import jax
from flax import nnx

from zoo.train.step import TrainState


def _checkpointer():
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


def _plain(state: TrainState) -> dict:
    return {"step": state.step, "params": nnx.to_pure_dict(state.params), "opt_state": state.opt_state}


def _abstract(x):
    sharding = getattr(x, "sharding", None)
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)


def save(path: str | Path, state: TrainState) -> Path:
    """Write ``state`` to the directory ``path`` (an existing one is replaced); returns it."""
    path = Path(path).absolute()
    if path.exists() and any(path.iterdir()):
        if not (path / "_CHECKPOINT_METADATA").exists():
            raise FileExistsError(f"{path} exists and is not an Orbax checkpoint; not replacing it")
        shutil.rmtree(path)
    elif path.exists():
        path.rmdir()
    ckptr = _checkpointer()
    ckptr.save(path, _plain(state))
    ckptr.wait_until_finished()
    return path


def restore(path: str | Path, like: TrainState) -> TrainState:
    """The state saved at ``path``, on the shapes, dtypes and shardings of ``like``."""
    target = jax.tree.map(_abstract, _plain(like))
    plain = _checkpointer().restore(Path(path).absolute(), target)
    params = jax.tree.map(lambda x: x, like.params)        # new Variables: ``like`` is not changed
    nnx.replace_by_pure_dict(params, plain["params"])
    return TrainState(plain["step"], params, plain["opt_state"])


def save_step(root: str | Path, state: TrainState) -> Path:
    """``save`` under ``root/step_{N}`` with N the state's step."""
    return save(Path(root) / f"step_{int(state.step)}", state)


def latest(root: str | Path) -> Path | None:
    """The ``step_N`` directory under ``root`` with the largest N, or None."""
    steps = [(int(m.group(1)), p) for p in Path(root).glob("step_*") if (m := re.fullmatch(r"step_(\d+)", p.name))]
    return max(steps)[1] if steps else None
