"""Compile targets of ``zoo compile``: a name, its topology for ``jax.experimental.topologies`` and
the accelerator type libtpu expects. No JAX import, so the CLI's parser (and ``zoo inspect`` /
``zoo plan``, which share it) starts without loading JAX."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """A compile target: its topology for ``jax.experimental.topologies`` and the accelerator type
    libtpu expects in the environment."""

    name: str
    platform: str
    topology: str
    accelerator_type: str
    backend: str            # the kernel dispatch backend its programs use (``zoo.kernels.dispatch``)


TARGETS = {t.name: t for t in [
    Target("v5e-1", "tpu", "v5e:1x1", "v5litepod-1", "tpu"),
    Target("v5e-4", "tpu", "v5e:2x2", "v5litepod-4", "tpu"),
    Target("v5e-8", "tpu", "v5e:2x4", "v5litepod-8", "tpu"),
    Target("v6e-8", "tpu", "v6e:2x4", "v6e-8", "tpu"),
    Target("v5p-8", "tpu", "v5p:2x2x1", "v5p-8", "tpu"),
    Target("cpu", "cpu", "host", "", "reference"),
]}


def get_target(name: str) -> Target:
    try:
        return TARGETS[name]
    except KeyError:
        raise ValueError(f"unknown compile target {name!r}; known: {', '.join(TARGETS)}") from None
