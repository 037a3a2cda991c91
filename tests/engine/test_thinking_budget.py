"""ThinkingBudget: when the closing text is forced (token ids, host side)."""

from __future__ import annotations

import pytest

from zoo.engine.thinking_budget import ThinkingBudget

OPEN, CLOSE, INSERT = (1,), (2,), (9, 2, 9)


def budget(n: int, opened: bool = False) -> ThinkingBudget:
    return ThinkingBudget(n, open=OPEN, close=CLOSE, insert=INSERT, opened=opened)


def test_opened_by_the_prompt_counts_from_the_first_token():
    b = budget(3, opened=True)
    assert b.observe([5]) == [] and b.observe([6]) == [] and b.observe([7]) == list(INSERT)
    assert b.observe([9, 2, 9, 5]) == []          # once only


def test_opened_in_the_output_counts_after_the_marker():
    b = budget(2)
    assert b.observe([5, 6, 7]) == []             # no reasoning yet: nothing to close
    assert b.observe([1]) == [] and b.observe([8]) == [] and b.observe([8]) == list(INSERT)


def test_the_model_closing_itself_is_never_forced():
    b = budget(3, opened=True)
    assert b.observe([5, 2]) == [] and b.closed
    assert b.observe([5, 5, 5, 5]) == []


def test_a_multi_token_step_crossing_the_budget():
    b = budget(3)
    assert b.observe([1, 5, 5, 5, 5, 5]) == list(INSERT) and b.used == 5     # overshoot by the step
    c = budget(3)
    assert c.observe([1, 5, 2, 5, 5, 5]) == []                               # closed inside the step


def test_markers_split_across_steps():
    b = ThinkingBudget(3, open=(1, 3), close=(2, 4), insert=(2, 4))
    assert b.observe([1]) == [] and b.observe([3, 5]) == [] and b.used == 1
    assert b.observe([2]) == [] and b.observe([4]) == [] and b.closed


def test_invalid_budgets():
    with pytest.raises(ValueError, match=">= 0"):
        budget(-1)
    with pytest.raises(ValueError, match="closing marker"):
        ThinkingBudget(3, open=OPEN, close=CLOSE, insert=(9,))
