"""The model's weights as the engine's programs take them: one flat tuple of arrays.

    weights = FlatState.of(state)        an ``nnx.State`` flattened once (its leaves and their treedef)
    as_state(weights) -> nnx.State       inside a program (or outside): the state again, for ``nnx.merge``

Every call of a jitted program flattens its arguments. An ``nnx.State`` flattens in Python, one
callback per parameter (``nnx.Variable``'s flatten), about 1 us each: measured on the embedded
glm53-tiny (264 leaves) the decode step's dispatch took 1.0-1.35 ms of a 2.2-2.6 ms step, and with
the weights passed as a flat tuple 0.63-0.70 ms (qwen38-tiny, 118 leaves: 0.50 -> 0.29 ms). A
full-size model has over a thousand parameters, and every decode step pays this on the host before
the device starts (the engine waits for each step's tokens). ``FlatState`` is one pytree node whose
children are the arrays themselves: one Python callback per call, then the arrays in C++.
"""

from __future__ import annotations

import jax


@jax.tree_util.register_pytree_node_class
class FlatState:
    """An ``nnx.State``'s leaves (``leaves``: a tuple) and their treedef (``treedef``, static)."""

    __slots__ = ("leaves", "treedef")

    def __init__(self, leaves, treedef):
        self.leaves, self.treedef = tuple(leaves), treedef

    @classmethod
    def of(cls, state) -> "FlatState":
        if isinstance(state, FlatState):
            return state
        leaves, treedef = jax.tree.flatten(state)
        return cls(leaves, treedef)

    def state(self):
        """The ``nnx.State`` (its leaves these arrays, or the tracers of a program's argument)."""
        return jax.tree.unflatten(self.treedef, self.leaves)

    def tree_flatten(self):
        return self.leaves, self.treedef

    @classmethod
    def tree_unflatten(cls, treedef, leaves):
        return cls(leaves, treedef)


def as_state(state):
    """``state`` as an ``nnx.State``: a ``FlatState``'s, or ``state`` itself."""
    return state.state() if isinstance(state, FlatState) else state
