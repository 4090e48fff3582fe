"""Grouping range reads into runs (pure): same file, gaps by the fetch rule, capped run size."""

from __future__ import annotations

import numpy as np

from otfload.accounting.gaps import MAX_GAP_FRACTION, PLANNED_GAPS
from otfload.accounting.requests import remote_fetch
from otfload.sources.base import RangeRead
from otfload.sources.runs import coalesce


def reads_of(spec: list[tuple[str, int, int]]) -> list[RangeRead]:
    return [RangeRead(f, off, memoryview(bytearray(n))) for f, off, n in spec]


def spans(runs) -> list[tuple[str, int, int]]:
    return [(r.file, r.start, r.end) for r in runs]


def test_adjacent_and_near_reads_merge_far_ones_do_not():
    reads = reads_of([("a", 0, 10), ("a", 10, 10), ("a", 25, 5), ("a", 100, 4)])
    assert spans(coalesce(reads, gap=5)) == [("a", 0, 30), ("a", 100, 104)]


def test_files_never_merge_and_order_is_by_file_then_offset():
    reads = reads_of([("b", 0, 4), ("a", 8, 4), ("a", 0, 4)])
    assert spans(coalesce(reads, gap=100)) == [("a", 0, 12), ("b", 0, 4)]


def test_big_reads_are_split_and_runs_capped():
    runs = coalesce(reads_of([("a", 3, 25), ("a", 28, 2)]), gap=0, max_run=10)
    assert spans(runs) == [("a", 3, 13), ("a", 13, 23), ("a", 23, 30)]
    assert [r.direct for r in runs] == [True, True, False]


def test_overlapping_reads_share_a_run_and_empty_reads_vanish():
    runs = coalesce(reads_of([("a", 0, 8), ("a", 4, 8), ("a", 50, 0)]), gap=0)
    assert spans(runs) == [("a", 0, 12)]
    assert [p.at for p in runs[0].pieces] == [0, 4]


def test_direct_run_writes_into_callers_buffer():
    (run,) = coalesce(reads_of([("a", 5, 7)]))
    assert run.direct and run.pieces[0].at == 0


# --- a planned batch: gaps within a bounded fraction of the bytes asked, as the plan predicts ----------


def column_block_reads(rows: int = 64, row_bytes: int = 32768, block: int = 1024) -> list[RangeRead]:
    return [RangeRead("f", i * row_bytes, memoryview(bytearray(block))) for i in range(rows)]


def test_a_planned_batch_reads_gaps_within_the_fraction_and_the_plan_predicts_it_exactly():
    reads = column_block_reads()
    asked = sum(len(r.out) for r in reads)
    runs = coalesce(reads, policy=PLANNED_GAPS)  # what a TensorReader passes to read_many
    fetched = sum(r.end - r.start for r in runs)
    assert asked <= fetched <= (1 + MAX_GAP_FRACTION) * asked  # 31 KiB gaps: none is worth it
    starts = np.array([r.offset for r in reads], np.int64)
    lengths = np.array([len(r.out) for r in reads], np.int64)
    _, planned, requests = remote_fetch(starts, lengths, PLANNED_GAPS)
    assert (int(planned.sum()), requests) == (fetched, len(runs))
    # Callers without a policy keep one gap's worth (1 MiB) per file: the whole 2 MiB span here.
    assert sum(r.end - r.start for r in coalesce(reads)) <= asked + (1 << 20) < 64 * 32768
