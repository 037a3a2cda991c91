"""Prefix cache: the prefill state of token prefixes, kept so a request that starts with a cached
prefix prefills only the rest (agents resend the whole conversation every turn).

Keys are token content. A prefix of N tokens is split into blocks of ``block`` tokens; block i's
key is a hash chain ``h_{i+1} = H(h_i, tokens of block i)`` from a root ``h_0 = H(identity)``
(the loaded model, its recipe and dtype, whether the MTP layer is cached, the block size), so an
entry of another model or layout can never match. Two kinds of entries:

    block     the per-token cache leaves (attention KV / MLA latents, GLM's pooled indexer keys,
              the slot bookkeeping, the MTP layer's slots) of one block's ``block`` slots, shared by
              every snapshot whose prefix holds that block
    snapshot  the state *exactly after* N tokens: every leaf without a token axis (linear-attention
              conv and recurrent states, GLM's indexer tails, the slot counters), the per-token
              leaves of the incomplete last block (a ``block``-wide window), and the last hidden
              state h_{N-1} (what the MTP layer needs to draft on: its row for token N pairs
              h_{N-1} with x_N); keyed ``H(h_j, tokens j*block .. N-1)`` for ``j = N // block``

Recurrent state cannot be rolled back, so a prefix is reusable only where a snapshot ends: a
request takes the longest N <= ``max_len`` with a snapshot whose blocks are all present.

What a leaf is comes from its logical axes (``zoo.sharding.cache_axes.token_axis``): a leaf with a
token axis is per token (``cache_len`` and ``latent_len``: one slot per token; ``pools``: one entry
per pool of tokens; the number of tokens per entry is read off the cache's shapes). The
cache rows this module reads and writes are compact (slot s holds position s), which the generator
guarantees (right-padded prefill pieces, the index rolled back to the real tokens).

Memory: entries live on the device (``device_bytes``, per chip, counted as shards) and, when that
tier is full, move to host RAM (``host_bytes``) in LRU order, then are dropped (a snapshot whose
block is dropped is dropped with it). The generator shrinks the device tier when a new request
needs room in the batch (``fit_device``), so the cache never keeps a request from being admitted.
This module holds no device programs: the generator passes the functions that slice and write rows.
"""

from __future__ import annotations

import collections
import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import numpy as np

from zoo.sharding.cache_axes import map_with_axes, token_axis
from zoo.sharding.mesh import host_value


def _digest(*parts: bytes) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return h.digest()


def _tok_bytes(tokens) -> bytes:
    return np.asarray(tokens, np.int32).tobytes()


def token_strides(cache, length: int) -> dict[str, int]:
    """``{leaf path: tokens per entry of its token axis}`` for a cache of ``length`` slots."""
    out = {}

    def visit(path, x, axes):
        a = token_axis(axes)
        if a is not None:
            size = x.shape[a]
            if length % size:
                raise ValueError(f"cache leaf {path}: {size} entries do not divide {length} slots")
            out[path] = length // size
        return x
    map_with_axes(visit, cache)
    return out


def split_leaves(cache, keep_token: bool):
    """The cache with only its per-token leaves (``keep_token``) or only the others; the rest None."""
    return map_with_axes(lambda _, x, axes: x if (token_axis(axes) is not None) == keep_token else None, cache)


def nbytes(tree, per_device: bool = True) -> int:
    """Bytes of a tree of arrays: a jax array counts one shard (``per_device``), numpy all of it."""
    total = 0
    for x in jax.tree.leaves(tree):
        if isinstance(x, jax.Array) and per_device:
            total += x.addressable_shards[0].data.nbytes
        else:
            total += x.nbytes
    return total


@dataclass(eq=False)
class _Entry:
    arrays: Any                      # a pytree of jax arrays (device tier) or numpy arrays (host tier)
    nbytes: int                      # per device on the device tier, all of it on the host tier
    tier: str = "device"


@dataclass(eq=False)
class Snapshot:
    """A usable prefix: ``length`` tokens, its block keys in order, and its own entry's key."""

    key: bytes
    length: int
    blocks: tuple[bytes, ...]
    base: bytes                      # chain key of its full blocks (the last of ``blocks``, or the root)
    partial: int                     # tokens past the last full block (0: no window stored)
    entry: _Entry = field(repr=False, default=None)

    @property
    def arrays(self):
        """``{"window": per-token leaves of the incomplete block or None, "state": the other leaves,
        "hidden": h_{N-1} [1, D]}``."""
        return self.entry.arrays


@dataclass
class PrefixStats:
    hits: int = 0                    # prefills that started from a cached prefix
    hit_tokens: int = 0              # prompt tokens restored from the cache
    miss_tokens: int = 0             # prompt tokens prefilled by requests that looked up
    stored_snapshots: int = 0
    stored_blocks: int = 0
    demoted: int = 0                 # entries moved device -> host
    evicted: int = 0                 # entries dropped from host RAM


class PrefixCache:
    """Blocks and snapshots of token prefixes in two LRU tiers (see the module doc).

    ``device_bytes`` / ``host_bytes``: the tiers' budgets (device: bytes per chip); ``block``:
    tokens per block. Used from one thread (the engine's); ``stats`` and the byte counts may be
    read from others."""

    def __init__(self, device_bytes: int, host_bytes: int, block: int = 256):
        if block < 1 or block & (block - 1):
            raise ValueError(f"block must be a power of two, got {block}")
        self.block = block
        self.device_budget = int(device_bytes)
        self.host_budget = int(host_bytes)
        self._blocks: dict[bytes, _Entry] = {}
        self._snaps: dict[bytes, Snapshot] = {}
        self._partials: dict[bytes, set[int]] = collections.defaultdict(set)   # base -> partial lengths
        self._users: dict[bytes, set[bytes]] = collections.defaultdict(set)    # block -> snapshot keys
        self._lru: collections.OrderedDict[tuple[str, bytes], None] = collections.OrderedDict()
        self.device_used = 0
        self.host_used = 0
        self.stats = PrefixStats()

    # -- keys -----------------------------------------------------------------------------------
    @staticmethod
    def root(identity: str) -> bytes:
        """The chain root for a model identity (a string naming everything the state depends on)."""
        return _digest(b"zoo-prefix-root", identity.encode())

    def chain(self, root: bytes, tokens, n_blocks: int) -> list[bytes]:
        """``[h_0 = root, h_1, .., h_n_blocks]`` over the first ``n_blocks`` blocks of ``tokens``."""
        keys, b = [root], self.block
        for i in range(n_blocks):
            keys.append(_digest(keys[-1], _tok_bytes(tokens[i * b:(i + 1) * b])))
        return keys

    @staticmethod
    def _snap_key(base: bytes, partial_tokens) -> bytes:
        return _digest(b"snapshot", base, _tok_bytes(partial_tokens))

    # -- lookup ---------------------------------------------------------------------------------
    def lookup(self, root: bytes, tokens, max_len: int) -> Snapshot | None:
        """The snapshot of the longest prefix of ``tokens`` of at most ``max_len`` tokens whose blocks
        are all cached, or None; a hit is marked recently used."""
        b = self.block
        max_len = min(max_len, len(tokens))
        chain = self.chain(root, tokens, max_len // b)
        present = 0                                   # chain[1..present] are all cached blocks
        while present + 1 < len(chain) and chain[present + 1] in self._blocks:
            present += 1
        for j in range(present, -1, -1):
            for r in sorted(self._partials.get(chain[j], ()), reverse=True):
                if j * b + r > max_len:
                    continue
                snap = self._snaps.get(self._snap_key(chain[j], tokens[j * b:j * b + r]))
                if snap is not None:
                    self._touch(snap)
                    return snap
        return None

    def holds(self, snap: Snapshot) -> bool:
        """Whether ``snap`` and all its blocks are still cached."""
        return snap.key in self._snaps and all(key in self._blocks for key in snap.blocks)

    def block_arrays(self, key: bytes):
        return self._blocks[key].arrays

    # -- store ----------------------------------------------------------------------------------
    def store(self, root: bytes, tokens, take_block: Callable[[int], Any], take_rest: Callable[[int | None], Any]
              ) -> Snapshot | None:
        """Cache the state after ``tokens`` (all of them): ``take_block(start)`` gives the per-token
        leaves of slots ``start .. start+block-1`` of the row that holds that state,
        ``take_rest(window_start or None)`` the snapshot's arrays (see ``Snapshot.arrays``). Blocks
        already cached are not taken again; an existing snapshot is only marked used."""
        n, b = len(tokens), self.block
        if n == 0:
            return None
        chain = self.chain(root, tokens, n // b)
        key = self._snap_key(chain[-1], tokens[(n // b) * b:])
        if key in self._snaps:
            self._touch(self._snaps[key])
            return self._snaps[key]
        for i, block_key in enumerate(chain[1:]):
            if block_key not in self._blocks:
                arrays = take_block(i * b)
                self._blocks[block_key] = _Entry(arrays, nbytes(arrays))
                self.device_used += self._blocks[block_key].nbytes
                self.stats.stored_blocks += 1
            self._lru[("block", block_key)] = None
            self._lru.move_to_end(("block", block_key))
        partial = n % b
        arrays = take_rest((n // b) * b if partial else None)
        snap = Snapshot(key, n, tuple(chain[1:]), chain[-1], partial, _Entry(arrays, nbytes(arrays)))
        self._snaps[key] = snap
        self._partials[snap.base].add(partial)
        for block_key in snap.blocks:
            self._users[block_key].add(key)
        self._lru[("snap", key)] = None
        self.device_used += snap.entry.nbytes
        self.stats.stored_snapshots += 1
        self.fit_device(self.device_budget)
        return snap

    # -- memory ---------------------------------------------------------------------------------
    def _touch(self, snap: Snapshot) -> None:
        for block_key in snap.blocks:
            self._lru.move_to_end(("block", block_key))
        self._lru.move_to_end(("snap", snap.key))

    def _entry(self, kind: str, key: bytes) -> _Entry:
        return self._blocks[key] if kind == "block" else self._snaps[key].entry

    def fit_device(self, limit: int) -> None:
        """Move least recently used entries to host RAM until the device tier holds at most
        ``min(limit, device budget)`` bytes; then drop host entries past the host budget."""
        limit = min(limit, self.device_budget)
        for kind, key in list(self._lru):
            if self.device_used <= limit:
                break
            entry = self._entry(kind, key)
            if entry.tier != "device":
                continue
            host = jax.tree.map(host_value, entry.arrays)    # several processes: all of it on each
            self.device_used -= entry.nbytes
            entry.arrays, entry.tier, entry.nbytes = host, "host", nbytes(host, per_device=False)
            self.host_used += entry.nbytes
            self.stats.demoted += 1
        for kind, key in list(self._lru):
            if self.host_used <= self.host_budget:
                break
            if (kind, key) in self._lru and self._entry(kind, key).tier == "host":
                self._drop(kind, key)

    def _drop(self, kind: str, key: bytes) -> None:
        entry = self._entry(kind, key)
        if entry.tier == "device":
            self.device_used -= entry.nbytes
        else:
            self.host_used -= entry.nbytes
        del self._lru[(kind, key)]
        self.stats.evicted += 1
        if kind == "block":
            del self._blocks[key]
            for snap_key in list(self._users.pop(key, ())):
                if snap_key in self._snaps:
                    self._drop("snap", snap_key)
            return
        snap = self._snaps.pop(key)
        self._partials[snap.base].discard(snap.partial)
        if not self._partials[snap.base]:
            del self._partials[snap.base]
        for block_key in snap.blocks:
            users = self._users.get(block_key)
            if users is not None:
                users.discard(key)

    def clear(self) -> None:
        """Drop every entry (not counted as evictions)."""
        evicted = self.stats.evicted
        for kind, key in list(self._lru):
            if (kind, key) in self._lru:
                self._drop(kind, key)
        self.stats.evicted = evicted

    @property
    def entries(self) -> dict[str, int]:
        return {"blocks": len(self._blocks), "snapshots": len(self._snaps)}
