"""``zoo.engine.replica`` in one process: a leader and a follower, each with its own ``Generator`` on
the tiny model, talking through an in-memory key-value store with the calls of ``jax.distributed``'s
(the real multi-process runs are ``tests/sharding/test_multihost*.py``). A request's options reach
the follower equal to the leader's, every field of them, and both engines stop at a stop string on
the same token, with the same text, seeds and finish."""

from __future__ import annotations

import dataclasses
import threading

import pytest

import zoo
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
def model():
    return zoo.load("qwen38-tiny", dtype="float32")


def test_a_follower_gets_the_options_and_stops_where_the_leader_does(model):
    tok = model.tokenizer
    prompt = tok.encode("Once upon")
    sampling = dict(max_new_tokens=20, temperature=0.8, top_p=0.95, top_k=50, seed=11)
    text = tok.decode(model.generate([prompt], **sampling)[0].tokens)        # choice 0's output, unstopped
    at = next(i for i in range(len(text) // 3, len(text) - 1) if text[i:i + 2].strip() == text[i:i + 2])
    needle = text[at:at + 2]
    options = RequestOptions(**sampling, stop=("never there", needle), stop_token_ids=(7,), n=2, logprobs=2,
                             detokenize=True, keep_special=("<tool_response>",), cache_marks=(2,))   # 7: that token

    store = MemoryStore()
    leader_gen, follower_gen = Generator(model, max_batch=4), Generator(model, max_batch=4)
    replayed = []
    follower_submit = follower_gen.submit
    follower_gen.submit = lambda req: replayed.append(req) or follower_submit(req)   # observed, not changed
    follower = Follower(follower_gen, Channel(store))
    thread = threading.Thread(target=follower.run, kwargs={"timeout_s": 600}, daemon=True)
    thread.start()
    leader = Leader(leader_gen, Channel(store))
    try:
        first = leader.submit(leader.make_request(prompt, options))
        assert set(first.replica_args["options"]) == {f.name for f in dataclasses.fields(RequestOptions)}
        assert first.replica_args == request_args(first)
        while not all(r.done.is_set() for r in [first] + first.forks):
            leader.step()
    finally:
        leader.close()
        thread.join(600)
    assert not thread.is_alive() and follower.n == leader.n
    [copy] = replayed
    assert copy.options == options and copy.options is not options
    for mine, theirs in zip([first] + first.forks, [copy] + copy.forks):
        assert mine.choice_seed == theirs.choice_seed
        assert (mine.tokens, mine.text, mine.finish_reason) == (theirs.tokens, theirs.text, theirs.finish_reason)
        assert mine.stats.get("stop_sequence") == theirs.stats.get("stop_sequence")
    assert (first.finish_reason, first.stats["stop_sequence"], first.text) == ("stop", needle, text[:text.find(needle)])
