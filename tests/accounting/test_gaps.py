"""The gap rule alone: smallest gaps first, each at most a limit, together within a budget; whole pages."""

from __future__ import annotations

import random

import numpy as np
import pytest

from otfload.accounting.gaps import (
    DEFAULT_GAPS,
    GAP_ALLOWANCE_BYTES,
    PLANNED_GAPS,
    GapPolicy,
    gap_budget,
    joined_gaps,
    merge_run_arrays,
    page_run_arrays,
)


def arrays(runs: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    return np.array([s for s, _ in runs], np.int64), np.array([n for _, n in runs], np.int64)


def as_runs(starts: np.ndarray, lengths: np.ndarray) -> list[tuple[int, int]]:
    return list(zip(starts.tolist(), lengths.tolist(), strict=True))


def reference(gaps: list[int], max_gap: int, budget: int) -> list[bool]:
    """The rule as its definition reads: walk the gaps smallest first, stop at the first that breaks a bound."""
    joined, spent = [False] * len(gaps), 0
    for gap, i in sorted((g, i) for i, g in enumerate(gaps)):
        if gap > max_gap or spent + gap > budget:
            break
        joined[i], spent = True, spent + gap
    return joined


def test_no_gaps_join_nothing():
    assert joined_gaps(np.array([], np.int64), max_gap=10, budget=10).tolist() == []
    starts, lengths = arrays([])
    assert as_runs(*merge_run_arrays(starts, lengths, 10, 10)) == []
    assert as_runs(*merge_run_arrays(*arrays([(5, 3)]), 10, 10)) == [(5, 3)]


def test_the_smallest_gaps_are_read_until_the_budget_is_spent():
    assert joined_gaps(np.array([5, 1, 3]), max_gap=10, budget=4).tolist() == [False, True, True]
    assert joined_gaps(np.array([5, 1, 3]), max_gap=10, budget=9).tolist() == [True, True, True]
    assert joined_gaps(np.array([5, 1, 3]), max_gap=10, budget=0).tolist() == [False, False, False]


def test_equal_gaps_are_taken_in_order_while_the_budget_lasts():
    assert joined_gaps(np.array([4, 4, 4]), max_gap=4, budget=8).tolist() == [True, True, False]


def test_a_gap_above_the_limit_is_never_read_whatever_the_budget():
    assert joined_gaps(np.array([50, 2, 20]), max_gap=10, budget=10**9).tolist() == [False, True, False]


def test_a_larger_gap_is_not_read_once_a_smaller_one_broke_the_budget():
    # 3 fits, 8 does not (3 + 8 > 5): taking stops there, so the 1-byte budget left reads nothing more
    assert joined_gaps(np.array([8, 3]), max_gap=10, budget=5).tolist() == [False, True]


def test_adjacent_runs_always_join():
    assert joined_gaps(np.array([0, 0, 7]), max_gap=0, budget=0).tolist() == [True, True, False]
    assert as_runs(*merge_run_arrays(*arrays([(0, 10), (10, 10), (20, 5), (30, 1)]), 0, 0)) == [(0, 25), (30, 1)]


@pytest.mark.parametrize("seed", range(20))
def test_the_rule_is_its_definition(seed):
    rng = random.Random(seed)
    gaps = [rng.choice([0, rng.randrange(1, 50), rng.randrange(50, 5000)]) for _ in range(rng.randrange(0, 40))]
    max_gap, budget = rng.choice([0, 10, 100, 10**6]), rng.choice([0, 20, 300, 10**6])
    assert joined_gaps(np.array(gaps, np.int64), max_gap, budget).tolist() == reference(gaps, max_gap, budget)


def test_runs_merge_across_the_smallest_gaps_within_the_budget():
    runs = [(0, 100), (110, 100), (400, 100), (1000, 100)]
    assert as_runs(*merge_run_arrays(*arrays(runs), max_gap=1000, budget=0)) == runs
    assert as_runs(*merge_run_arrays(*arrays(runs), max_gap=1000, budget=10)) == [(0, 210), (400, 100), (1000, 100)]
    assert as_runs(*merge_run_arrays(*arrays(runs), max_gap=1000, budget=200)) == [(0, 500), (1000, 100)]
    assert as_runs(*merge_run_arrays(*arrays(runs), max_gap=100, budget=10**9)) == [(0, 210), (400, 100), (1000, 100)]


def test_page_runs_are_whole_pages_clipped_to_the_tensor():
    # a tensor at file offset 100, 10000 bytes long; pages of 4096
    runs = arrays([(0, 10), (9000, 10), (9100, 10)])
    assert as_runs(*page_run_arrays(*runs, base=100, limit=10000, page=4096)) == [(0, 3996), (8092, 1908)]
    touching = arrays([(0, 10), (5000, 10), (9990, 10)])  # neighbouring pages: one range
    assert as_runs(*page_run_arrays(*touching, base=100, limit=10000, page=4096)) == [(0, 10000)]
    assert as_runs(*page_run_arrays(*arrays([]), base=100, limit=10000, page=4096)) == []


def test_the_budget_is_the_fraction_or_the_allowance_per_file_whichever_is_more():
    assert gap_budget(1000, 2, GapPolicy(0.1, 50)) == 100
    assert gap_budget(1000, 3, GapPolicy(0.1, 50)) == 150
    assert gap_budget(0, 0, GapPolicy(0.1, 50)) == 0
    assert gap_budget(10**6, 4, PLANNED_GAPS) == 10**5  # a planned read: the fraction only
    assert gap_budget(1000, 2, DEFAULT_GAPS) == 2 * GAP_ALLOWANCE_BYTES
