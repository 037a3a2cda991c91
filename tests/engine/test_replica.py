"""``zoo.engine.replica`` in one process: a leader and a follower, each with its own ``Generator`` on
the tiny model, talking through an in-memory key-value store with the calls of ``jax.distributed``'s
(the real multi-process runs are ``tests/sharding/test_multihost*.py``). A request's options reach
the follower equal to the leader's, every field of them, and both engines stop at a stop string on
the same token, with the same text, seeds and finish. The model is the demo model's config with one decoder
layer of each kind and random weights (``random_tiny_checkpoint``): the replay is the engine's, whatever
the weights, and the 4-row programs are those of ``test_constraint``'s model."""

from __future__ import annotations

import contextlib
import dataclasses
import threading

import pytest

from tests.support.helpers import random_tiny_model
from zoo.engine.generator import Generator
from zoo.engine.options import RequestOptions
from zoo.engine.replica import Channel, Follower, Leader, request_args


class MemoryStore:
    """The key-value store calls ``Channel`` makes of the distributed runtime's client, in memory."""

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()

    def key_value_set_bytes(self, key: str, value: bytes) -> None:
        with self._changed:
            self._data[key] = value
            self._changed.notify_all()

    def blocking_key_value_get_bytes(self, key: str, timeout_ms: int) -> bytes:
        with self._changed:
            if not self._changed.wait_for(lambda: key in self._data, timeout_ms / 1000):
                raise RuntimeError(f"DEADLINE_EXCEEDED: no value for {key}")
            return self._data[key]

    def key_value_delete(self, key: str) -> None:
        with self._changed:
            self._data.pop(key, None)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return random_tiny_model(tmp_path_factory)


@contextlib.contextmanager
def leader_and_follower(leader_gen: Generator, follower_gen: Generator):
    """A ``Leader`` over ``leader_gen`` and a ``Follower`` over ``follower_gen`` on its own thread,
    talking through a ``MemoryStore``; yields (leader, follower, the requests the follower was
    submitted). On the way out the leader stops the follower, which must end."""
    replayed = []
    follower_submit = follower_gen.submit
    follower_gen.submit = lambda req: replayed.append(req) or follower_submit(req)   # observed, not changed
    store = MemoryStore()
    follower = Follower(follower_gen, Channel(store))
    thread = threading.Thread(target=follower.run, kwargs={"timeout_s": 600}, daemon=True)
    thread.start()
    leader = Leader(leader_gen, Channel(store))
    try:
        yield leader, follower, replayed
    finally:
        leader.close()
        thread.join(600)
    assert not thread.is_alive() and follower.n == leader.n


def test_a_follower_gets_the_options_and_stops_where_the_leader_does(model):
    tok = model.tokenizer
    prompt = tok.encode("Once upon")
    sampling = dict(max_new_tokens=20, temperature=0.8, top_p=0.95, top_k=50, seed=11)
    text = tok.decode(model.generate([prompt], **sampling)[0].tokens)        # choice 0's output, unstopped
    at = next(i for i in range(len(text) // 3, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2])
    needle = text[at:at + 2]
    options = RequestOptions(**sampling, stop=("never there", needle), stop_token_ids=(7,), n=2, logprobs=2,
                             detokenize=True, keep_special=("<tool_response>",), cache_marks=(2,))   # 7: that token

    with leader_and_follower(Generator(model, max_batch=4), Generator(model, max_batch=4)) as (leader, _, replayed):
        first = leader.submit(leader.make_request(prompt, options))
        assert set(first.replica_args["options"]) == {f.name for f in dataclasses.fields(RequestOptions)}
        assert first.replica_args == request_args(first)
        while not all(r.done.is_set() for r in [first] + first.forks):
            leader.step()
    [copy] = replayed
    assert copy.options == options and copy.options is not options
    for mine, theirs in zip([first] + first.forks, [copy] + copy.forks):
        assert mine.choice_seed == theirs.choice_seed
        assert (mine.tokens, mine.text, mine.finish_reason) == (theirs.tokens, theirs.text, theirs.finish_reason)
        assert mine.stats.get("stop_sequence") == theirs.stats.get("stop_sequence")
    assert (first.finish_reason, first.stats["stop_sequence"], first.text) == ("stop", needle, text[:text.find(needle)])


def test_followers_narrow_the_prefill_pieces_the_leader_does(model):
    """A long prompt arrives while a stream decodes. The leader's prefill time budget narrows its
    pieces from the leader's timings (here a table that makes every piece narrow); the follower, whose
    own timings differ, loads the leader's table with each plan and runs the same pieces: the same
    prefill tokens at every step, and the same outputs."""
    # test_interleave's shape (4 rows, 1024 tokens, pieces of 64): its programs
    make = lambda: Generator(model, max_batch=4, context=1024, prefill_chunk=64, prefix_cache=0,   # noqa: E731
                             interleave_ratio=3.0)
    leader_gen, follower_gen = make(), make()
    # two 16-token pieces per step (the follower's own timings of this tiny model allow one or none)
    slow = {"decode": 1.0, "pieces": {"16": 1.0, "64": 4.0}}
    leader_gen.pace.piece_took = leader_gen.pace.decode_took = lambda *a: None    # the table stays
    leader_gen.pace.load(slow)
    prefilled = {"leader": [], "follower": []}
    for name, gen in (("leader", leader_gen), ("follower", follower_gen)):
        step = gen.step
        gen.step = lambda step=step, gen=gen, name=name: (  # noqa: E731
            prefilled[name].append(gen.prefill_tokens), step())[1]
    with leader_and_follower(leader_gen, follower_gen) as (leader, _, replayed):
        stream = leader.submit(leader.make_request([5, 17, 200, 33], max_new_tokens=40))
        for _ in range(3):
            leader.step()
        long = leader.submit(leader.make_request([(7 * i + 3) % 230 + 10 for i in range(150)], max_new_tokens=4))
        while not (stream.done.is_set() and long.done.is_set()):
            leader.step()
    steps = [b - a for a, b in zip(prefilled["leader"][1:], prefilled["leader"][2:])]
    assert 32 in steps and 64 not in steps                        # narrowed while the stream decoded
    assert prefilled["follower"] == prefilled["leader"]
    assert [r.tokens for r in replayed] == [stream.tokens, long.tokens] and len(long.tokens) == 4
