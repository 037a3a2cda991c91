"""The abstract mesh a plan is made for: ``devices`` chips in a layout, with no devices attached."""

from __future__ import annotations

from jax.sharding import AbstractMesh

from zoo.sharding.mesh import get_layout


def plan_mesh(layout: str, devices: int) -> AbstractMesh:
    """The abstract mesh ``zoo.sharding.mesh.make_mesh(layout)`` builds on ``devices`` devices."""
    lay = get_layout(layout)
    return AbstractMesh(lay.mesh_shape(devices), lay.axis_names)
