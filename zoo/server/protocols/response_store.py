"""The Responses API's store: stored responses by id, each a turn of its conversation.

A stored response is a ``Turn``: the turn it continued (``previous_response_id``), its own items
(its input, then its output) and its response object. A conversation is the chain of turns, each
holding only what it added, so a chain of n turns takes O(n) memory, not O(n^2). A turn also keeps
its prompt as rendered and tokenized (``Turn.prompt``): the next turn's prompt shares most of its
text, and its tokens up to there are reused (``zoo.text.tokenizer.Encoded``), so a long chain is
not tokenized again from the start at every turn. Only a chain's latest turn keeps its prompt (a
turn continuing another drops the other's), and a prompt counts against ``max_bytes``.

Bounds: the store's index holds the last ``limit`` responses looked up or stored (the least recent
go first) and at most ``max_bytes`` of turns (their items' and response's JSON). A turn stays as long
as it is in the index or a turn after it is: evicting a response from the index never breaks a
conversation that continues from a later one (its turns count against ``max_bytes`` until the last
of them goes). ``get`` answers a response in the index; anything else is not found.
"""

from __future__ import annotations

import collections
import json
from dataclasses import dataclass, field

STORE_LIMIT = 256          # stored responses kept for previous_response_id (the least recently used go first)
STORE_BYTES = 256 << 20    # and at most this many bytes of turns (their JSON)


def prompt_bytes(prompt) -> int:
    """About the memory an ``Encoded`` prompt takes: its text, and two Python ints per token."""
    return 0 if prompt is None else len(prompt.text) + 72 * len(prompt.ids)


@dataclass(eq=False)
class Turn:
    """One stored response: ``parent`` (the turn it continued, or None), its own ``items`` (input
    then output), its ``response`` object, ``size`` (its JSON bytes and its prompt's), ``prompt``
    (its rendered and tokenized prompt, an ``Encoded``; None once a turn continuing it is stored,
    whose prompt holds the same and more). ``holders``: the index entry and the turns after it that
    keep it."""

    parent: "Turn | None"
    items: list[dict]
    response: dict
    size: int
    prompt: object = None
    holders: int = 0
    depth: int = field(init=False)

    def __post_init__(self):
        self.depth = 0 if self.parent is None else self.parent.depth + 1

    def conversation(self) -> list[dict]:
        """Every item of the chain up to and including this turn's, in order."""
        chain, turn = [], self
        while turn is not None:
            chain.append(turn.items)
            turn = turn.parent
        return [item for items in reversed(chain) for item in items]


class ResponseStore:
    """See the module doc. ``bytes``: the size of every turn kept."""

    def __init__(self, limit: int = STORE_LIMIT, max_bytes: int = STORE_BYTES):
        self.limit, self.max_bytes, self.bytes = limit, max_bytes, 0
        self._index: collections.OrderedDict[str, Turn] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._index)

    def put(self, response_id: str, parent: Turn | None, items: list[dict], response: dict,
            prompt=None) -> Turn | None:
        """Store a response continuing ``parent`` with its own ``items``; the new turn, or None when
        it alone exceeds ``max_bytes`` (it is not kept)."""
        size = len(json.dumps(items)) + len(json.dumps(response)) + prompt_bytes(prompt)
        if size > self.max_bytes:
            return None
        self._drop(response_id)
        turn = Turn(parent, items, response, size, prompt)
        self._hold(turn)
        if parent is not None and parent.prompt is not None:   # the new turn's prompt supersedes it
            freed, parent.prompt = prompt_bytes(parent.prompt), None
            parent.size -= freed
            self.bytes -= freed                                # held: by the new turn at least
        self._index[response_id] = turn
        while len(self._index) > self.limit or self.bytes > self.max_bytes:
            self._release(self._index.popitem(last=False)[1])
        return turn if self._index.get(response_id) is turn else None

    def get(self, response_id: str) -> Turn | None:
        turn = self._index.get(response_id)
        if turn is not None:
            self._index.move_to_end(response_id)
        return turn

    def _drop(self, response_id: str) -> None:
        turn = self._index.pop(response_id, None)
        if turn is not None:
            self._release(turn)

    def _hold(self, turn: Turn) -> None:
        """One more holder of ``turn``; a turn held again (new, or freed while its request ran)
        counts its bytes and holds its parent."""
        while turn is not None:
            turn.holders += 1
            if turn.holders > 1:
                return
            self.bytes += turn.size
            turn = turn.parent

    def _release(self, turn: Turn) -> None:
        """One holder fewer; a turn nobody holds frees its bytes and releases its parent."""
        while turn is not None:
            turn.holders -= 1
            if turn.holders:
                return
            self.bytes -= turn.size
            turn = turn.parent
