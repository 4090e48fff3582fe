"""Fetching runs in parallel on the process's fetch threads: exact bytes, bounded, cancelled together."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from otfload.accounting.gaps import DEFAULT_GAPS, PLANNED_GAPS
from otfload.accounting.requests import REMOTE_CHUNK_BYTES, remote_fetch
from otfload.sources.base import RangeRead
from otfload.sources.fetch_threads import FETCH_THREADS, read_chunked, read_runs
from otfload.sources.runs import coalesce
from tests.sources.test_runs import reads_of

FILES = {"a": bytes(range(256)) * 64, "b": bytes(reversed(range(256))) * 64}  # 16 KiB each


def fetch_from_files(file: str, offset: int, out: memoryview) -> None:
    out[:] = FILES[file][offset : offset + len(out)]


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


def test_at_most_max_workers_runs_of_a_batch_are_fetched_at_once():
    lock, now, peak = threading.Lock(), [0], [0]

    def counting(file: str, offset: int, out: memoryview) -> None:
        with lock:
            now[0] += 1
            peak[0] = max(peak[0], now[0])
        time.sleep(0.01)
        fetch_from_files(file, offset, out)
        with lock:
            now[0] -= 1

    reads = reads_of([("a", i * 100, 10) for i in range(12)])
    read_runs(coalesce(reads, gap=0), counting, max_workers=3)
    assert peak[0] == 3
    assert [r.out.tobytes() for r in reads] == [FILES["a"][i * 100 : i * 100 + 10] for i in range(12)]


def test_fetch_threads_are_reused_across_calls():
    seen: set[int] = set()

    def recording(file: str, offset: int, out: memoryview) -> None:
        seen.add(threading.get_ident())
        fetch_from_files(file, offset, out)

    for _ in range(30):
        read_runs(coalesce(reads_of([("a", i * 100, 10) for i in range(4)]), gap=0), recording, max_workers=4)
    assert threading.get_ident() not in seen
    assert len(seen) <= FETCH_THREADS  # a pool per call would have started up to 120 threads


def test_a_fetch_that_reads_runs_itself_does_not_wait_for_the_busy_threads():
    """Every shared thread busy with a fetch that reads runs of its own: those run in that thread."""

    def nested(file: str, offset: int, out: memoryview) -> None:
        inner = reads_of([("b", offset + i, 1) for i in range(0, 40, 10)])
        read_runs(coalesce(inner, gap=0), fetch_from_files, max_workers=4)
        fetch_from_files(file, offset, out)
        assert [r.out.tobytes() for r in inner] == [FILES["b"][offset + i : offset + i + 1] for i in range(0, 40, 10)]

    reads = reads_of([("a", i * 100, 10) for i in range(FETCH_THREADS + 8)])
    runs = coalesce(reads, gap=0)
    outcome: list[BaseException | None] = []
    worker = threading.Thread(target=lambda: outcome.append(read_runs(runs, nested, max_workers=len(runs))))
    worker.start()
    worker.join(timeout=30)
    assert not worker.is_alive() and outcome == [None]
    assert all(r.out.tobytes() == FILES["a"][r.offset : r.offset + 10] for r in reads)


def test_read_chunked_reads_the_gaps_its_caller_allows_and_the_plan_predicts():
    reads = [RangeRead("a", i * 256, memoryview(bytearray(16))) for i in range(64)]  # 240-byte gaps
    starts = np.array([r.offset for r in reads], np.int64)
    lengths = np.array([len(r.out) for r in reads], np.int64)
    asked: list[tuple[int, int]] = []

    def recording(file: str, offset: int, out: memoryview) -> None:
        asked.append((offset, len(out)))
        fetch_from_files(file, offset, out)

    # what a TensorReader passes: 10% of 1 KiB allows no 240-byte gap
    read_chunked(reads, recording, REMOTE_CHUNK_BYTES, 4, PLANNED_GAPS)
    planned, planned_lengths, requests = remote_fetch(starts, lengths, PLANNED_GAPS)
    assert sorted(asked) == list(zip(planned.tolist(), planned_lengths.tolist(), strict=True))
    assert len(asked) == requests == 64
    assert all(bytes(r.out) == FILES["a"][r.offset : r.offset + 16] for r in reads)
    asked.clear()
    read_chunked(reads, recording, REMOTE_CHUNK_BYTES, 4, DEFAULT_GAPS)  # one gap's worth per file, all joined
    assert asked == [(0, 63 * 256 + 16)] and remote_fetch(starts, lengths)[2] == 1
