"""One model over several processes (``zoo.distributed``): 2 processes x 4 CPU devices (gloo
collectives) against 1 process x 8 devices, both models, "tp" and "ep".

Each process reads only its own devices' slices, every parameter is one global array, and the
logits, MTP logits, greedy and speculative tokens equal the single-process run's. Startup errors
(a process count the processes do not agree on, an unreachable coordinator, bad arguments) end with
a clear error inside the timeout. Every process a test starts is ended by the test.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.sharding.test_sharding import GLM, QWEN, QWEN_BIG
from tests.support.multihost import run_job, start, tail, wait_all
from tests.support.paths import DATA
from tests.support.random_checkpoints import write_random_checkpoint
from zoo.distributed import DistributedError, check_args

TOL = 1e-5


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_two_processes_match_one_one_model_per_layout(tmp_path):
    """Qwen (dense) on "tp", GLM (routed experts) on "ep": the code paths of a multi-process load and
    generation do not depend on the model beyond its layout (each model on both layouts is checked
    on one process's 8 devices in ``test_sharding``). Greedy generation for both; MTP drafting over
    two processes is the engine session's below (Qwen, k=2), and GLM's MTP layer over two processes
    is checked here by its logits (drafting GLM here too took 22 s more of the 70 s alone)."""
    paths = {"qwen": str(write_random_checkpoint(tmp_path / "qwen", QWEN, seed=2)),
             "glm": str(write_random_checkpoint(tmp_path / "glm", GLM, seed=1))}
    args = {"paths": paths, "layouts": {"qwen": ["tp"], "glm": ["ep"]}, "decoding": {"qwen": "greedy", "glm": "greedy"}}
    one = run_job("forward", args, tmp_path / "one", processes=1, devices=8)[0]
    two = run_job("forward", args, tmp_path / "two", processes=2, devices=4)
    assert [r["processes"] for r in two] == [2, 2] and one["processes"] == 1
    for key in [f"{m}/{lay}" for m in paths for lay in args["layouts"][m]]:
        for r in two:
            for what in ("logits", "mtp"):
                assert rel(r["arrays"][f"{key}/{what}"], one["arrays"][f"{key}/{what}"]) <= TOL, (key, what)
            what = args["decoding"][key.split("/")[0]]
            assert np.array_equal(r["arrays"][f"{key}/{what}"], one["arrays"][f"{key}/{what}"]), (key, what)
            # each process holds half of what one process over all 8 devices holds, and reads less
            # than the whole checkpoint where the layout splits the weights it reads
            assert r[key]["devices"] == 4
            assert r[key]["local_param_bytes"] == one[key]["local_param_bytes"] // 2, (key, r[key], one[key])
            assert r[key]["read_bytes"] <= one[key]["read_bytes"], key
        if key.endswith("/tp"):
            assert two[0][key]["read_bytes"] < 0.75 * one[key]["read_bytes"], (key, two[0][key], one[key])


def test_bad_arguments_fail_before_connecting():
    for args, match in [(("127.0.0.1:1234", 2, None), "together"), (("127.0.0.1", 2, 0), "HOST:PORT"),
                        (("127.0.0.1:1234", 2, 2), "outside 0..1"), (("127.0.0.1:1234", 0, 0), ">= 1")]:
        with pytest.raises(DistributedError, match=match):
            check_args(*args)


@pytest.mark.parametrize("case", ["missing process", "no coordinator"])
def test_startup_that_cannot_complete_is_a_clear_error_in_bounded_time(tmp_path, case):
    """Process 0 waits for a second process that never comes; a process pointed at a port where no
    coordinator listens. Both end with ``DistributedError`` naming the coordinator within the timeout."""
    kw = {"num_processes": 2} if case == "missing process" else {"num_processes": 2, "coordinator": "127.0.0.1:9"}
    t0 = time.monotonic()
    procs = start("tests.support.multihost_checks", ["join", '{"timeout_s": 5, "out": "%s"}' % tmp_path],
                  1, 2, tmp_path, **kw)
    if case == "no coordinator":                  # the process with id 0 is the one that serves; run id 1
        procs[0].kill()
        procs[0].wait()
        procs = start("tests.support.multihost_checks", ["join", '{"timeout_s": 5, "out": "%s"}' % tmp_path],
                      1, 2, tmp_path, env={"ZOO_PROCESS_ID": "1"}, **kw)
    codes = wait_all(procs, timeout=90)
    log = tail(tmp_path)
    assert time.monotonic() - t0 < 90
    if case == "missing process":                 # the watchdog's line, before XLA's own abort
        assert codes == [2] and "could not join coordinator 127.0.0.1:" in log and "fewer came" in log, log
    else:
        assert codes == [1] and "DistributedError: the coordinator 127.0.0.1:9 is unreachable" in log, log


def test_cache_saved_by_one_process_restores_on_two_and_the_reverse(tmp_path):
    """The repacked-weight cache written by 1 process x 8 devices is restored by 2 x 4, and one written
    by 2 x 4 (Orbax's multi-process save: each writes its shards, process 0 the manifest) by 1 x 8;
    the same logits every way (GLM, "ep")."""
    path = str(write_random_checkpoint(tmp_path / "glm", GLM, seed=1))
    one_way = {"path": path, "cache_dir": str(tmp_path / "saved-by-one"), "layout": "ep"}
    other_way = {**one_way, "cache_dir": str(tmp_path / "saved-by-two")}
    saved = run_job("cache", one_way, tmp_path / "a", processes=1, devices=8)[0]
    restored = run_job("cache", one_way, tmp_path / "b", processes=2, devices=4)
    saved2 = run_job("cache", other_way, tmp_path / "c", processes=2, devices=4)
    restored2 = run_job("cache", other_way, tmp_path / "d", processes=1, devices=8)[0]
    assert saved["source"] != "cache" and [r["source"] for r in restored] == ["cache", "cache"]
    assert [r["source"] for r in saved2] != ["cache"] * 2 and restored2["source"] == "cache"
    assert len({r["cache_path"] for r in saved2}) == 1
    entries = sorted(p.name for p in (tmp_path / "saved-by-two").iterdir())
    assert len(entries) == 1 and not entries[0].startswith(".partial"), entries
    want = saved["arrays"]["logits"]
    for r in restored + saved2 + [restored2]:
        assert rel(r["arrays"]["logits"], want) <= TOL


def test_each_process_restores_only_its_own_shards_of_the_cache(tmp_path):
    """A cache of a ~200 MB model saved by 1 x 8 ("tp") and restored by 2 x 4: each process reads
    (``rchar``: every byte through a system call) about the bytes of its own devices' distinct
    shards, well under the whole state, and its digests check; the logits equal the saver's."""
    path = str(write_random_checkpoint(tmp_path / "big", QWEN_BIG, seed=3))
    args = {"path": path, "cache_dir": str(tmp_path / "cache"), "layout": "tp"}
    saved = run_job("cache", args, tmp_path / "a", processes=1, devices=8)[0]
    restored = run_job("cache", args, tmp_path / "b", processes=2, devices=4)
    state = sum(f.stat().st_size for f in (tmp_path / "cache").rglob("*") if f.is_file() and "state" in f.parts)
    print(f"cache state {state / 1e6:.1f} MB; each of 2 x 4 read "
          f"{[round(r['read_chars'] / 1e6, 1) for r in restored]} MB for its "
          f"{[round(r['local_bytes'] / 1e6, 1) for r in restored]} MB of shards")
    for r in restored:
        assert r["source"] == "cache" and rel(r["arrays"]["logits"], saved["arrays"]["logits"]) <= TOL
        assert r["local_bytes"] < 0.8 * state
        assert r["read_chars"] < 1.05 * r["local_bytes"] + (1 << 20), (r["read_chars"], r["local_bytes"])


def test_a_quantized_gguf_over_two_processes_matches_one(tmp_path):
    """llama.cpp's GLM q256 fixture (IQ2_S / IQ3_S / Q6_K / Q8_0 experts and projections, kept in their
    ggml types) on "ep": 2 x 4 gives one process x 8's logits, and each process reads half of the
    routed experts' bytes that one process reads (its own devices' experts; "ep" replicates the rest)."""
    args = {"path": str(DATA / "glm53-q256-udmix.gguf"), "layout": "ep"}
    one = run_job("gguf", args, tmp_path / "one", processes=1, devices=8)[0]
    two = run_job("gguf", args, tmp_path / "two", processes=2, devices=4)
    print(f"GGUF bytes read: 1 x 8 {one['read_bytes']}, each of 2 x 4 {[r['read_bytes'] for r in two]}")
    for r in two:
        assert rel(r["arrays"]["logits"], one["arrays"]["logits"]) <= TOL
        assert r["read_bytes"]["experts"] == one["read_bytes"]["experts"] // 2


def test_an_engine_session_driven_by_process_0_replays_on_the_other(tmp_path):
    """``zoo.engine.replica``: process 0 takes requests between steps (one arrives at step 3 and
    samples, one is cancelled at step 5, MTP k=2 under the auto speculation policy) and publishes
    each step's arrivals, cancellations and step costs; process 1 replays them. Process 1 made every
    decision process 0 made (the same options, every token of every request, the sampled one too);
    the greedy requests' tokens and every finish reason equal one process running the session (its
    sampled request may take other draft lengths there: its own timings)."""
    path = str(write_random_checkpoint(tmp_path / "qwen", QWEN, seed=2))
    args = {"path": path, "layout": "tp"}
    one = run_job("replica", args, tmp_path / "one", processes=1, devices=8)[0]
    leader, follower = run_job("replica", args, tmp_path / "two", processes=2, devices=4)
    assert one["finish"] == ["length", "cancelled", "length"] and leader["finish"] == one["finish"]
    assert follower["steps"] == leader["steps"] and follower["options"] == leader["options"]
    assert sum(leader["options"].values()) > 0 and len([o for o, n in leader["options"].items() if n]) > 1
    for key, want in leader["arrays"].items():
        assert np.array_equal(follower["arrays"][key], want), key
    for key in ("tokens0", "tokens1"):
        assert np.array_equal(leader["arrays"][key], one["arrays"][key]), key
