"""Memory of the prefix cache's entries for a model at full size, per chip, from its config alone.

    prefix_cache_plan(name, devices=8, layout="tp", mtp=True, block=256) -> dict

The cache's leaves (``init_cache`` of the abstract model, no weights) are split as the serving
cache is (their logical axes on a ``devices``-chip mesh of ``layout``). What an entry holds is what
``zoo.engine.prefix_cache`` stores:

    per_token   bytes per token of the leaves with a token axis (KV / latents, pooled indexer keys,
                slot bookkeeping, the MTP layer's slots when ``mtp``)
    block       ``block`` tokens of those
    state       the leaves without a token axis: linear-attention conv + recurrent states, GLM's
                indexer tail pools, counters
    snapshot    state + the hidden state h_{N-1} (+ a block-wide window when N is not a block multiple)
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from zoo import registry
from zoo.models.architectures import architecture
from zoo.sharding.cache_axes import map_with_axes, token_axis
from zoo.sharding.device_plan import plan_mesh
from zoo.sharding.mesh import partition_spec

LENGTH = 4096                  # slots of the cache the per-token figures are read from


def _shard_bytes(x, axes, mesh) -> int:
    spec = partition_spec(tuple(axes), tuple(x.shape), mesh)
    n = math.prod(x.shape)
    for entry in spec:
        for axis in (entry,) if isinstance(entry, str) else entry or ():
            n //= mesh.shape[axis]
    return n * x.dtype.itemsize


def prefix_cache_plan(name: str, devices: int = 8, layout: str = "tp", mtp: bool = True, block: int = 256,
                      dtype: str = "bfloat16", config=None) -> dict:
    """Bytes per chip of the prefix cache's entries for registry model ``name`` (or ``config``)."""
    cfg = config if config is not None else registry.preset_config(registry.get_spec(name))
    model_class = architecture(cfg.arch).model_class()
    module = nnx.eval_shape(lambda: model_class(cfg, dtype=jnp.dtype(dtype)))
    cache = jax.eval_shape(lambda: module.init_cache(1, LENGTH))
    if not mtp or getattr(module, "mtp", None) is None:
        cache = cache.without_mtp()
    mesh = plan_mesh(layout, devices)
    token, state = [0], [0]

    def visit(_, x, axes):
        (token if token_axis(axes) is not None else state)[0] += _shard_bytes(x, axes, mesh)
        return x
    map_with_axes(visit, cache)
    per_token = token[0] / LENGTH
    hidden = cfg.hidden_size * jnp.dtype(dtype).itemsize if mtp else 0
    return {"model": name, "devices": devices, "layout": layout, "mtp": mtp, "block": block,
            "per_token": per_token, "block_bytes": int(per_token * block), "state": state[0],
            "snapshot": state[0] + hidden, "snapshot_with_window": state[0] + hidden + int(per_token * block)}


def summary(p: dict) -> str:
    mib = 2**20
    return (f"prefix cache entries of {p['model']} per chip ({p['devices']} chips, {p['layout']}, "
            f"{'with' if p['mtp'] else 'without'} MTP): {p['per_token'] / 1024:.1f} KiB per token, "
            f"{p['block_bytes'] / mib:.1f} MiB per block of {p['block']}, snapshot {p['snapshot'] / mib:.1f} MiB "
            f"(+{p['block_bytes'] / mib:.1f} MiB window when mid-block)")
