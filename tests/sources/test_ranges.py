"""Coalescing range reads into runs (pure) and fetching runs in parallel."""

from __future__ import annotations

import random
import threading
import time

import pytest

from otfload.errors import SourceProtocolError
from otfload.sources.base import RangeRead
from otfload.sources.ranges import FETCH_THREADS, RangeAnswer, RangeSink, coalesce, read_runs
from otfload.sources.retry import TransientError

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


# --- RangeSink.drain: a body read with readinto, straight into the caller's buffer ------------------


def _body_reader(body: bytes, largest: int):
    """``readinto`` over ``body`` that gives at most ``largest`` bytes per call (a socket's way)."""
    at = 0
    calls = []

    def readinto(out: memoryview) -> int:
        nonlocal at
        n = min(len(out), largest, len(body) - at)
        out[:n] = body[at : at + n]
        at += n
        calls.append(len(out))
        return n

    return readinto, calls


@pytest.mark.parametrize("largest", [1, 7, 1000])
@pytest.mark.parametrize("piece", [3, 64, 4096])
def test_drain_writes_a_206_body_in_place(largest, piece):
    body = bytes(random.Random(1).randbytes(500))
    out = memoryview(bytearray(520))
    sink = RangeSink(RangeAnswer(0, 500, 500, False), out, 20, "f")
    readinto, calls = _body_reader(body, largest)
    sink.drain(readinto, piece)
    sink.finish()
    assert bytes(out[20:]) == body and bytes(out[:20]) == bytes(20)
    assert sink.done == 520 and sink.seen == 500
    assert max(calls) <= piece


def test_drain_skips_a_200_head_and_stops_once_the_wanted_bytes_are_in():
    whole = bytes(range(256)) * 4
    out = memoryview(bytearray(100))
    sink = RangeSink(RangeAnswer(300, 100, len(whole), True), out, 0, "f")
    readinto, calls = _body_reader(whole, 1000)
    sink.drain(readinto, 64)
    sink.finish()
    assert bytes(out) == whole[300:400]
    assert sink.seen == 400  # the rest of the body was left unread


def test_drain_reads_a_200_without_length_to_its_end():
    whole = bytes(range(200))
    out = memoryview(bytearray(50))
    sink = RangeSink(RangeAnswer(10, 50, len(whole), False), out, 0, "f")
    sink.drain(_body_reader(whole, 1000)[0], 16)
    sink.finish()
    assert bytes(out) == whole[10:60] and sink.seen == 200


def test_drain_rejects_a_body_longer_than_announced():
    out = memoryview(bytearray(100))
    sink = RangeSink(RangeAnswer(0, 100, 100, False), out, 0, "file.safetensors")
    with pytest.raises(SourceProtocolError, match="file.safetensors: the body is longer than the 100 bytes"):
        sink.drain(_body_reader(bytes(101), 1000)[0], 64)


def test_drain_keeps_a_short_body_and_finish_asks_for_the_rest():
    out = memoryview(bytearray(100))
    sink = RangeSink(RangeAnswer(0, 100, 100, False), out, 0, "f")
    sink.drain(_body_reader(b"\x07" * 60, 1000)[0], 16)
    assert sink.done == 60 and bytes(out[:60]) == b"\x07" * 60
    with pytest.raises(TransientError, match="ended after 60 of 100 bytes"):
        sink.finish()
