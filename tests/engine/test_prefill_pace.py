"""``zoo.engine.prefill_pace``: the time budget of a step's prefill pieces while rows decode, on
given timings (the engine's use of it is ``test_interleave``'s; replicas deciding alike, ``test_replica``)."""

from __future__ import annotations

import json

import pytest

from zoo.engine.fill import Fill, piece_at, plan_pieces, snapshot_points
from zoo.engine.options import RequestOptions
from zoo.engine.prefill_pace import PrefillPace
from zoo.engine.request import Request


def table(decode, pieces):
    return {"decode": decode, "pieces": pieces}


def test_the_widest_piece_that_fits_the_allowance_then_the_small_one_then_none():
    pace = PrefillPace(3.0)                                    # pieces may take 2 decode steps
    t = table(1.0, {16: 0.5, 64: 1.5})
    assert pace.allowance(t) == 2.0
    assert pace.choose(t, 0.0, 64, 16, first=True) == 64       # 1.5 <= 2
    assert pace.choose(t, 1.5, 64, 16, first=False) == 16      # 1.5 + 1.5 > 2, 1.5 + 0.5 <= 2
    assert pace.choose(t, 2.0, 64, 16, first=False) is None    # nothing fits: the step's prefill ends
    slow = table(1.0, {16: 5.0, 64: 20.0})
    assert pace.choose(slow, 0.0, 64, 16, first=True) == 16    # the first piece always runs, narrowed
    assert pace.choose(slow, 5.0, 64, 16, first=False) is None


def test_untimed_widths_are_estimated_per_token_and_nothing_timed_means_no_limit():
    t = table(1.0, {16: 0.5})
    assert PrefillPace.estimate(t, 64) == 2.0 and PrefillPace.estimate(t, 16) == 0.5
    assert PrefillPace.estimate(table(1.0, {}), 64) is None
    pace = PrefillPace(3.0)
    assert pace.choose(t, 0.0, 64, 16, first=True) == 64                       # 2.0 <= 2.0
    assert pace.choose(table(1.0, {}), 0.0, 64, 16, first=True) == 16          # unknown: narrowed
    assert pace.choose(table(1.0, {}), 0.0, 64, 16, first=False) is None
    assert pace.choose(table(None, {16: 9.0}), 9.0, 64, 16, first=False) == 64   # no decode step timed
    assert PrefillPace(None).choose(t, 99.0, 64, 16, first=False) == 64          # no ratio: tokens only


def test_running_means_and_lockstep_processes_decide_only_from_a_shared_table():
    pace = PrefillPace(2.0, lockstep=True)
    pace.decode_took(1.0)
    pace.decode_took(2.0)
    pace.piece_took(16, 4.0)
    assert pace.decode_s == pytest.approx(1.25) and pace.piece_s == {16: 4.0}
    assert pace.allowance(pace.snapshot()) is None                # lockstep, nothing shared yet
    pace.load(json.loads(json.dumps(pace.export())))               # as a plan carries it
    assert pace.shared and pace.piece_s == {16: 4.0} and pace.allowance(pace.snapshot()) == 1.25


@pytest.mark.parametrize("ratio", [0.5, 0.0, -1.0, float("nan")])
def test_a_ratio_below_one_is_refused(ratio):
    with pytest.raises(ValueError, match="interleave ratio must be >= 1"):
        PrefillPace(ratio)


def test_narrowed_pieces_end_at_the_same_snapshot_points():
    """Narrowing changes the widths, never where snapshots are taken; unnarrowed, ``Fill.piece``
    walks ``plan_pieces``' plan."""
    chunk, small, slots = 64, 16, 512
    for start, n, marks in [(0, 300, ()), (5, 200, (50,)), (64, 129, ()), (0, 10, ())]:
        ends = snapshot_points(start, n, chunk, marks)
        for narrow_every in (0, 1, 2):
            f = Fill([Request(list(range(n)), RequestOptions(max_new_tokens=1))], [0], ends, None, None, start)
            pieces, i = [], 0
            while not f.done:
                piece = f.piece(chunk, small, slots, narrow=bool(narrow_every) and i % narrow_every == 0)
                pieces.append(piece)
                f.pos, i = piece[1], i + 1
            assert [p[0] for p in pieces] == [start] + [p[1] for p in pieces[:-1]] and pieces[-1][1] == n
            assert [p[1] for p in pieces if p[3]] == ends
            assert all(w in (small, chunk) and 0 < e - a <= w for a, e, w, _ in pieces)
            if not narrow_every:
                assert pieces == plan_pieces(start, n, chunk, small, slots, marks)
            if narrow_every == 1:
                assert all(w == small for _, _, w, _ in pieces)
    assert piece_at(0, 300, chunk, small, 40) == (16, 16)          # the chunk does not fit the row's slots


def test_zoo_serve_takes_the_ratio_or_0_and_refuses_anything_else():
    import subprocess
    import sys

    from zoo.cli.serve import _interleave_ratio

    assert _interleave_ratio("0") is None and _interleave_ratio("2.5") == 2.5
    bad = subprocess.run([sys.executable, "-m", "zoo", "serve", "--interleave-ratio", "0.5"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--interleave-ratio: expected a number >= 1 (decode steps) or 0 (off)" in bad.stderr
