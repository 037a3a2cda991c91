"""Filling an abstract model from a weight source, one tensor at a time.

    fill_from_source(abstract, source, name_map, store, mesh) -> (module, unused source keys)

Each source tensor is resolved to its parameter by the architecture's name map, handed to a
storage function (``zoo.quant.storage``: what the parameter holds) and, with a mesh, placed shard
by shard (``zoo.sharding.placement``). Tensors that are slices of one parameter (per-expert
tensors of a bank) are stacked through a ``StackedSlices`` view.
"""

from __future__ import annotations

import collections
import concurrent.futures

import jax
import numpy as np
from flax import nnx

from zoo.quant.storage import dense_store
from zoo.sharding.placement import full_index, place, source_index
from zoo.sources.base import SourceError, TensorInfo, WeightSource
from zoo.sources.names import NameMap, Target, apply_transform

AHEAD_WORKERS = 2                 # threads reading and repacking tensors ahead of the fill (one device)
AHEAD_BYTES = 512 << 20           # source bytes in flight at most (one tensor at least)


class StackedSlices:
    """A one-tensor source view: the source tensors ``keys[i]`` stacked along a new first axis, for a
    parameter filled slice by slice (a ``Rule`` with ``index``, e.g. one tensor per expert). Its only
    key is ``name`` (the slices' name with ``*`` for the index).

    Float slices of a plain matmul weight (transform "matmul") are stacked as stored, ``[E, out,
    in]``, and the view hands that transform on (``store_transform``): every storage function then
    sees the bank as it sees a GGUF bank (and may quantize it). Any other transform is applied to
    each slice here, and the view holds the parameter layout (``store_transform`` None)."""

    def __init__(self, source, keys: list[str], target: Target, want: jax.ShapeDtypeStruct):
        self.source, self.slice_keys, self.target, self.want = source, keys, target, want
        self.name = target.sibling(keys[0], "*")
        first = source.info(keys[0])
        keeps = target.transform == "matmul" and not getattr(first, "quantized", False)
        self.slice_transform = None if keeps else target.transform
        self.store_transform = target.transform if keeps else None
        self.shape = (len(keys), *first.shape) if keeps else tuple(want.shape)

    def keys(self) -> list[str]:
        return [self.name]

    def info(self, key: str) -> TensorInfo:
        return TensorInfo(self.source.info(self.slice_keys[0]).dtype, self.shape)

    def read(self, key: str, index=()) -> np.ndarray:
        """``stacked[index]``; for slices of a float source through a re-indexing transform, only the
        selected slices' selected parts are read."""
        index = full_index(index, len(self.shape))
        if not all(isinstance(i, slice) for i in index):
            return self._read_part(range(len(self.slice_keys)), ())[index]
        return self._read_part(range(len(self.slice_keys))[index[0]], index[1:])

    def _read_part(self, picks: range, inner: tuple) -> np.ndarray:
        shape = self.shape[1:]
        inner = full_index(inner, len(shape))
        stacked = None
        for n, i in enumerate(picks):
            k = self.slice_keys[i]
            info = self.source.info(k)
            axes = None if getattr(info, "quantized", False) else source_index(
                self.slice_transform, tuple(range(len(shape))))
            if axes is not None and tuple(shape[a] for a in axes) == tuple(info.shape):
                part = apply_transform(self.slice_transform, self.source.read(k, tuple(inner[a] for a in axes)))
            else:
                part = apply_transform(self.slice_transform, self.source.read(k))
                if part.shape != shape:
                    raise SourceError(f"tensor {k!r} has shape {tuple(info.shape)}; slice {i} of parameter "
                                      f"{self.target.path} needs {shape} (after layout transform "
                                      f"{self.slice_transform!r})")
                part = part[inner]
            if stacked is None:
                stacked = np.empty((len(picks),) + part.shape, part.dtype)
            stacked[n] = part
        return stacked


def _stacked_view(source, slices: dict[int, str], target: Target, want) -> StackedSlices:
    """Check that ``slices`` (slice index -> source key) covers the parameter's first axis exactly."""
    n = want.shape[0]
    some_key = next(iter(slices.values()))
    extra = sorted(i for i in slices if i >= n)
    if extra:
        raise SourceError(f"tensor {slices[extra[0]]!r}: slice {extra[0]} is out of range for parameter "
                          f"{target.path} ({n} slices)")
    missing = [i for i in range(n) if i not in slices]
    if missing:
        names = ", ".join(repr(target.sibling(some_key, i)) for i in missing[:4])
        raise SourceError(f"the checkpoint has no tensor {names}"
                          f"{f' and {len(missing) - 4} more' if len(missing) > 4 else ''} "
                          f"(slice(s) {missing[:4]} of parameter {target.path})")
    return StackedSlices(source, [slices[i] for i in range(n)], target, want)


def fill_from_source(abstract: nnx.Module, source: WeightSource, name_map: NameMap, store=dense_store, mesh=None,
                     select=None) -> tuple[nnx.Module, list[str]]:
    """Fill an abstract module's parameters from ``source``; returns (module, unused source keys).

    Each source tensor is read on its own and handed to ``store`` (see ``dense_store``); tensors that
    are slices of one parameter (``Rule.index``) are handed over stacked, as one ``StackedSlices``
    view. With a ``mesh``, each parameter is placed shard by shard with the sharding its logical
    axes have there (``zoo.sharding.placement``). Raises ``SourceError`` naming the tensor on a shape
    mismatch or a missing slice, and naming the parameters that no source tensor provided.
    ``select``: a predicate on dotted parameter paths; only those parameters are filled (and
    required), the others keep their abstract values (an MTP overlay, ``zoo.loader.overlay``).
    """
    graphdef, state = nnx.split(abstract)
    flat = nnx.to_flat_state(state)
    params = {".".join(map(str, path)): var for path, var in flat}
    if select is not None:
        params = {path: var for path, var in params.items() if select(path)}
    filled, unused = set(), []
    sliced: dict[str, tuple[Target, dict[int, str]]] = {}
    plain: list[tuple[str, Target]] = []
    for key in source.keys():
        if name_map.ignored(key):
            continue
        hit = name_map.resolve(key)
        if hit is None or hit.path not in params:
            unused.append(key)
            continue
        if hit.index is not None:
            sliced.setdefault(hit.path, (hit, {}))[1][hit.index] = key
            continue
        plain.append((key, hit))
    if mesh is None:        # read and repack ahead on worker threads, set in file order
        for (key, hit), value in _stored_ahead(store, source, plain, params):
            _set(params[hit.path], value, key, hit.path)
            filled.add(hit.path)
    else:
        for key, hit in plain:
            _fill(params[hit.path], store, source, key, hit.transform, hit.path, mesh)
            filled.add(hit.path)
    for path, (target, slices) in sliced.items():
        view = _stacked_view(source, slices, target, params[path].get_value())
        _fill(params[path], store, view, view.name, view.store_transform, path, mesh)
        filled.add(path)
    missing = sorted(set(params) - filled)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise SourceError(f"the checkpoint has no tensor for parameter(s): {shown}")
    return nnx.merge(graphdef, nnx.from_flat_state(flat)), unused


def _stored_ahead(store, source, items: list[tuple[str, Target]], params: dict):
    """``((key, target), store(...))`` for each of ``items``, in order, computed up to ``AHEAD_BYTES`` of
    source tensors ahead on ``AHEAD_WORKERS`` threads (reading releases the GIL, and so do numpy's
    copies and XLA's dequantization): one core reads while another repacks, and host memory holds at
    most that window of tensors in flight besides the model. A failure is raised at its tensor."""
    size = lambda key: int(getattr(source.info(key), "nbytes", 0) or 0)       # noqa: E731
    with concurrent.futures.ThreadPoolExecutor(AHEAD_WORKERS, thread_name_prefix="zoo-fill") as pool:
        pending: collections.deque = collections.deque()
        inflight, nxt = 0, 0
        try:
            for _ in items:
                while nxt < len(items) and (not pending or inflight + size(items[nxt][0]) <= AHEAD_BYTES):
                    key, hit = items[nxt]
                    want = params[hit.path].get_value()
                    pending.append((items[nxt], size(key),
                                    pool.submit(store, source, key, hit.transform, want, hit.path)))
                    inflight += size(key)
                    nxt += 1
                item, nbytes, future = pending.popleft()
                inflight -= nbytes
                yield item, future.result()
        finally:
            for _, _, future in pending:
                future.cancel()


def _set(var, value, key: str, path: str) -> None:
    if tuple(value.shape) != tuple(var.get_value().shape):
        raise SourceError(f"tensor {key!r}: stored shape {tuple(value.shape)} != parameter {path} "
                          f"shape {var.get_value().shape}")
    var.set_value(value)


def _fill(var, store, source, key: str, transform, path: str, mesh=None) -> None:
    """Store source tensor ``key`` into the parameter ``var`` (at ``path``), on ``mesh`` if given."""
    if mesh is None:
        value = store(source, key, transform, var.get_value(), path)
    else:
        value = place(store, source, key, transform, var.get_value(), var.get_metadata()["axes"], path, mesh)
    if tuple(value.shape) != tuple(var.get_value().shape):
        raise SourceError(f"tensor {key!r}: stored shape {tuple(value.shape)} != parameter {path} "
                          f"shape {var.get_value().shape}")
    var.set_value(value)
