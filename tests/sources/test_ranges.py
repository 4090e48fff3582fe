"""Coalescing range reads into runs (pure) and fetching runs in parallel."""

from __future__ import annotations

import random

import pytest

from otfload.sources.base import RangeRead
from otfload.sources.ranges import coalesce, read_runs

FILES = {"a": bytes(range(256)) * 64, "b": bytes(reversed(range(256))) * 64}  # 16 KiB each


def reads_of(spec: list[tuple[str, int, int]]) -> list[RangeRead]:
    return [RangeRead(f, off, memoryview(bytearray(n))) for f, off, n in spec]


def fetch_from_files(file: str, offset: int, out: memoryview) -> None:
    out[:] = FILES[file][offset : offset + len(out)]


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


@pytest.mark.parametrize("seed", range(5))
def test_random_reads_get_exact_bytes(seed):
    rng = random.Random(seed)
    spec = []
    for _ in range(60):
        file = rng.choice("ab")
        off = rng.randrange(len(FILES[file]))
        spec.append((file, off, rng.randrange(0, min(3000, len(FILES[file]) - off) + 1)))
    reads = reads_of(spec)
    runs = coalesce(reads, gap=rng.choice([0, 16, 512]), max_run=rng.choice([64, 1000, 1 << 20]))
    read_runs(runs, fetch_from_files, max_workers=4)
    for r in reads:
        assert bytes(r.out) == FILES[r.file][r.offset : r.offset + len(r.out)]


def test_reads_into_typed_buffers():
    import numpy as np

    out = np.zeros(4, dtype=np.float32)
    read_runs(coalesce([RangeRead("a", 16, memoryview(out))]), fetch_from_files)
    assert out.tobytes() == FILES["a"][16:32]


def test_first_failure_is_raised():
    def failing(file: str, offset: int, out: memoryview) -> None:
        if offset >= 100:
            raise OSError(f"boom at {offset}")
        fetch_from_files(file, offset, out)

    with pytest.raises(OSError, match="boom"):
        read_runs(coalesce(reads_of([("a", i * 50, 10) for i in range(6)]), gap=0), failing, max_workers=3)
