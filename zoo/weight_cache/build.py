"""Building a cache entry with bounded host memory: fill one parameter group, write it, drop it.

    build(name_or_path, *, quant=None, dtype="bfloat16", root, progress=True) -> Path

The entry is the one ``zoo.load(name_or_path, quant=quant, dtype=dtype, cache=root)`` writes (same
directory name, fingerprint, config, manifest ``params`` and digests, tokenizer), written without
ever holding the model: "prepare on CPU, serve on TPU" (a 30 GB CPU machine writes the cache of a
120 GB model; a TPU job restores it). The sources are opened as ``zoo.load`` opens them
(``zoo.loader.open.open_checkpoint``: the recipe's storage function, recipes mixing in a GGUF or naming a whole one,
the MTP layer a checkpoint has without its config saying so), the model is built abstractly once,
the source's tensors are sorted once by the group of the parameter they map to (the name map), and
then, for each parameter group in entry order (the embedding, ``layers.0`` ... ``layers.N-1``, the
head, ``mtp``, the final norm: ``store._group``)::

    fill          fill_from_source(abstract, a view of the group's source tensors, select=this
                  group): the group's Variables get values (mesh None: each on the default device,
                  the host on a CPU machine)
    take          the values are taken out and the Variables set back to their abstract values
    write         store.write_entry saves the group's leaves (Orbax) and digests them
    drop          the values and the leaf dict go before the next group is filled

What is held at once: the arrays of ONE group (the biggest group bounds the peak: a layer with its
expert banks as stored or quantized, or a large-vocabulary embedding / head), the source tensors
being read for it (memory maps of the files: page cache, not the process's own memory, except the
temporary copies a read, transform or quantizer makes of the tensor at hand, e.g. an expert bank
stacked in the source dtype), Orbax's write buffers of the group, the abstract model and the
manifest entries (metadata only). No group's arrays outlive its write
(``tests/weight_cache/test_build.py`` checks it with weak references).

One process only (``jax.process_count() == 1``): the multi-host path is ``zoo.load(..., mesh=...,
cache=...)``, which loads the whole model sharded over the job and saves it (``store.save``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import nnx

from zoo.loader.fill import fill_from_source
from zoo.loader.open import check_recipe, dtype_of, open_checkpoint, resolve
from zoo.models.architectures import architecture
from zoo.weight_cache import store


class _Only:
    """A view of a weight source holding only ``keys`` (the tensors of one parameter group): the
    fill of a group resolves its own tensors, not every tensor of the checkpoint again."""

    def __init__(self, source, keys: list[str]):
        self._source, self._keys, self._set = source, keys, set(keys)

    def keys(self) -> list[str]:
        return list(self._keys)

    def __contains__(self, key: str) -> bool:
        return key in self._set

    def __getattr__(self, name):              # info, read and anything else: the source's own
        return getattr(self._source, name)


def _keys_by_group(source, name_map) -> dict[str, list[str]]:
    """The source tensors each parameter group is filled from (ignored and unmapped tensors in none)."""
    out: dict[str, list[str]] = {}
    for key in source.keys():
        if name_map.ignored(key):
            continue
        hit = name_map.resolve(key)
        if hit is not None:
            out.setdefault(store._group(hit.path), []).append(key)
    return out


def _in_group(group: str, path: str) -> bool:
    return store._group(path) == group


def filled_groups(abstract, members: dict[str, list[str]], source, name_map, storage):
    """Yield ``(group, {leaf index: array}, {path: manifest entry})`` for each group of ``members``
    (group -> its dotted parameter paths, in entry order), each filled from ``source`` into the
    Variables of ``abstract``, which are set back to their abstract values before the group is
    handed on (so the model never holds more than the group being filled)."""
    variables = {".".join(map(str, path)): var for path, var in nnx.to_flat_state(nnx.state(abstract))}
    shapes = {path: var.get_value() for path, var in variables.items()}
    keys = _keys_by_group(source, name_map)
    for group, paths in members.items():
        try:            # fill_from_source sets the values on these Variables (its result shares them)
            fill_from_source(abstract, _Only(source, keys.get(group, [])), name_map, storage,
                             select=functools.partial(_in_group, group))
            values = [(path, variables[path].get_value()) for path in paths]
        finally:
            for path in paths:
                variables[path].set_value(shapes[path])
        arrays, entries = store.pack_group(group, values)
        del values
        yield group, arrays, entries
        del arrays, entries                                  # before the next group is filled


def build(name_or_path: str | Path, *, quant: str | None = None, dtype="bfloat16", root: str | Path,
          progress: bool = True, vision: bool = True, mmproj=None) -> Path:
    """Write the cache entry of ``zoo.load(name_or_path, quant=quant, dtype=dtype)`` under ``root``,
    one parameter group in memory at a time (see the module doc); returns the entry's directory.

    An existing complete entry of the same request is replaced (looking one up first is the
    caller's business: ``zoo cache build``). ``vision=False``: without a multimodal checkpoint's
    vision tower (as ``zoo.load(..., vision=False)``). ``progress``: a tqdm bar on stderr naming the group
    being written (on a terminal)."""
    if jax.process_count() > 1:
        raise RuntimeError(f"zoo.weight_cache.build runs in one process (this job has {jax.process_count()}); "
                           "to write a cache from a multi-process job, load on its mesh: "
                           "zoo.load(..., mesh=..., cache=DIR)")
    dtype_name = jnp.dtype(dtype_of(dtype)).name
    check_recipe(name_or_path, quant)
    ckpt = resolve(name_or_path)
    source, cfg, name_map, tokenizer, storage, _ = open_checkpoint(ckpt, quant, dtype_name, vision, mmproj)
    model_class = architecture(cfg.arch).model_class()
    abstract = nnx.eval_shape(lambda: model_class(cfg, dtype=dtype_name))
    members: dict[str, list[str]] = {}
    for path, _ in nnx.to_flat_state(nnx.state(abstract)):
        dotted = ".".join(map(str, path))
        members.setdefault(store._group(dotted), []).append(dotted)
    fp = store.request_fingerprint(name_or_path, quant, dtype_name, vision, mmproj)
    return store.write_entry(filled_groups(abstract, members, source, name_map, storage), root, fp,
                             store.entry_name(name_or_path, ckpt), cfg, tokenizer, total=len(members),
                             desc="zoo cache build", progress=progress)
