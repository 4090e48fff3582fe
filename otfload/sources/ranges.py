"""Turning many small range reads into few parallel requests, for remote sources.

:func:`coalesce` is pure: it merges reads of one file that are adjacent or close (the gap is read
and thrown away, cheaper than another round trip) and splits big reads so that no request exceeds
``max_run`` bytes. :func:`read_runs` fetches the runs with bounded concurrency and scatters the
bytes into the callers' buffers; the first failure cancels the rest.
:class:`FetchMeter` counts what a load really asks of its storage (bytes and requests, gaps read to
save requests and pages prefetched included): sources record their own fetches with
:func:`fetching`, and :func:`expected_fetch` counts a read as asked when the source records nothing.
:func:`check_range_answer` and :class:`RangeSink` check an HTTP answer to a ``Range`` request
(status, ``Content-Range``, lengths, encoding) so that no wrong byte is ever taken for a right one.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from otfload.errors import SourceProtocolError
from otfload.sources.base import RangeRead
from otfload.sources.retry import CancelToken, LoadCancelled, TransientError, cancel_scope, current_token

# The gap *between two ranges of one remote file* that one request may read through instead of
# making two requests: 1 MiB costs ~1 ms at 1 GB/s, less than one round trip (5-50 ms). Much larger
# than read.reader.BOX_SPAN_GAP_BYTES (32 KiB), whose alternative is a ~2 µs local read, not a request.
REMOTE_REQUEST_GAP_BYTES = 1 << 20
# ... but the gaps of one batch together stay within this fraction of the bytes asked for, or one
# gap's worth per file (at most one round trip's time), whichever is more: when a process needs a
# column block, the gaps are the other processes' columns (merging every gap below 1 MiB fetched 64
# MiB for 2 MiB needed, issue 17).
MAX_GAP_FRACTION = 0.1
GAP_ALLOWANCE_BYTES = REMOTE_REQUEST_GAP_BYTES
# Cap on one request: bounds the temporary buffer of a coalesced run and splits huge tensors into
# pieces that can be fetched in parallel and retried cheaply.
MAX_RUN_BYTES = 64 << 20
# Requests in flight per read_many: enough to hide object-store latency at ~1 GB/s with multi-MiB
# runs, few enough to stay under per-host connection limits and bound in-flight bytes
# (MAX_CONCURRENT_READS x MAX_RUN_BYTES).
MAX_CONCURRENT_READS = 16
# Threads fetching runs for every read_runs call of the process, made once: a pool per call cost a
# thread start per run (the loader's 8 builders read a stack chunk at a time), the largest user of
# the GIL in a Hub load after the HTTP client. Above the requests in flight of a few sources (each
# source bounds its own, MAX_REQUESTS_IN_FLIGHT); a batch queues behind the others past it.
FETCH_THREADS = 64
# Remote sources (hub.py, fsspec_source.py; issue 20): a large range is fetched as concurrent chunks of
# this size straight into the caller's buffer. At a 50 MB/s stream with a 20 ms round trip a chunk takes
# ~170 ms, so latency costs <= 11% per stream, while a 64 MiB leaf still spreads over 8 streams;
# measured on the shaped test Hub (docs/benchmarks_remote.md), 8 MiB fills the link as 16 and 32 MiB do.
REMOTE_CHUNK_BYTES = 8 << 20
# ... and a smaller read is still split in up to this many pieces of at least MIN_CHUNK_BYTES: a
# stacked leaf reads its layers one after another, so one layer's 6 MB read as one stream at 50 MB/s
# held a whole leaf to ~30 MB/s; in 4 pieces a 0.55 GB load from the shaped Hub took 2.8 s, not
# 3.9 s (8 pieces: 3.0 s, more requests for nothing; docs/benchmarks_remote.md).
READ_SPLIT = 4
# Below this a piece is worth less than its round trip (1 MiB takes 21 ms at 50 MB/s, a 20 ms RTT).
MIN_CHUNK_BYTES = 1 << 20
# Requests one remote source has in flight at once, over all its threads: 16 streams of >= 50 MB/s
# fill 800 MB/s; fewer than huggingface_hub's 20 kept-alive connections (more are closed after each
# request and re-opened: a TCP + TLS handshake, 2-3 round trips, on a real network); in-flight bytes
# stay <= 16 x 8 MiB for sources that stage a chunk (gcsfs returns each body as one bytes object).
MAX_REQUESTS_IN_FLIGHT = 16

# A server ignoring Range answers 200 with the whole file: discarding up to this many leading bytes
# (one MAX_RUN_BYTES run) is cheaper than failing; beyond it the read is refused, typed.
MAX_SKIP_BYTES = MAX_RUN_BYTES
_FETCHERS: ThreadPoolExecutor | None = None
_FETCHERS_LOCK = threading.Lock()


class _FetchThreadState(threading.local):
    active = False  # this thread is fetching a run now


_IN_FETCH_THREAD = _FetchThreadState()
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")

FetchInto = Callable[[str, int, memoryview], None]


def remote_chunk_bytes(nbytes: int, largest: int = REMOTE_CHUNK_BYTES) -> int:
    """The request size for a remote read of ``nbytes``: READ_SPLIT pieces of at least
    MIN_CHUNK_BYTES, at most ``largest`` each."""
    return min(largest, max(MIN_CHUNK_BYTES, -(-nbytes // READ_SPLIT)))


class FetchMeter:
    """Bytes and requests a load really fetched from its storage; shared by the load's threads.

    A child meter (``parent=``) adds everything it records to its parent as well.
    """

    def __init__(self, parent: FetchMeter | None = None):
        self.bytes = 0
        self.requests = 0
        self.parent = parent
        self._lock = threading.Lock()

    def add(self, nbytes: int, requests: int = 1) -> None:
        with self._lock:
            self.bytes += nbytes
            self.requests += requests
        if self.parent is not None:
            self.parent.add(nbytes, requests)


_metering = threading.local()  # .meter: this thread's FetchMeter; .inside: within a recorded fetch


def current_meter() -> FetchMeter | None:
    """The meter of the load this thread works for, if any."""
    return getattr(_metering, "meter", None)


@contextmanager
def metering(meter: FetchMeter | None) -> Iterator[FetchMeter | None]:
    """Make ``meter`` this thread's :func:`current_meter` for the duration of the block."""
    previous, inside = current_meter(), getattr(_metering, "inside", False)
    _metering.meter, _metering.inside = meter, False
    try:
        yield meter
    finally:
        _metering.meter, _metering.inside = previous, inside


@contextmanager
def fetching(nbytes: int, requests: int = 1) -> Iterator[None]:
    """Record one fetch of ``nbytes`` from storage (a request, a ``preadv``, a prefetched range).

    Fetches made inside it (a remote source reading its own local copy) are not counted again.
    """
    meter = current_meter()
    if meter is None or getattr(_metering, "inside", False):
        yield
        return
    meter.add(nbytes, requests)
    _metering.inside = True
    try:
        yield
    finally:
        _metering.inside = False


@contextmanager
def expected_fetch(nbytes: int, requests: int = 1) -> Iterator[None]:
    """A read about to be asked of a source: counted as ``nbytes`` in ``requests`` requests unless
    the source records its own fetches (then those count: coalesced runs, retries' requests)."""
    meter = current_meter()
    if meter is None or getattr(_metering, "inside", False):
        yield
        return
    child = FetchMeter(parent=meter)
    _metering.meter = child
    try:
        yield
    finally:
        _metering.meter = meter
    if child.requests == 0:
        meter.add(nbytes, requests)


@dataclass(frozen=True)
class Piece:
    """A caller's buffer ``out`` that receives the run's bytes starting ``at`` bytes into the run."""

    at: int
    out: memoryview


@dataclass(frozen=True)
class Run:
    """One request: bytes ``[start, end)`` of ``file``, delivered to ``pieces``."""

    file: str
    start: int
    end: int
    pieces: tuple[Piece, ...]

    @property
    def direct(self) -> bool:
        """True when a single buffer covers the run exactly, so it can be read into without a copy."""
        return len(self.pieces) == 1 and self.pieces[0].at == 0 and len(self.pieces[0].out) == self.end - self.start


def _split(read: RangeRead, max_run: int) -> list[tuple[int, memoryview]]:
    out = read.out.cast("B")
    return [(read.offset + i, out[i : i + max_run]) for i in range(0, len(out), max_run)]


_gaps = threading.local()  # .policy: (fraction, allowance per file) of this thread's coalesce calls


@contextmanager
def gap_policy(fraction: float, allowance: int = 0) -> Iterator[None]:
    """Within the block, :func:`coalesce` (every remote source's ``read_many``) reads gaps of at most
    ``fraction`` of the bytes asked, or ``allowance`` per file: a reader that planned its pieces says
    how much it may fetch beyond them."""
    previous = getattr(_gaps, "policy", None)
    _gaps.policy = (fraction, allowance)
    try:
        yield
    finally:
        _gaps.policy = previous


def _gap_budget(asked: int, files: int, fraction: float | None = None) -> int:
    policy_fraction, allowance = getattr(_gaps, "policy", None) or (MAX_GAP_FRACTION, GAP_ALLOWANCE_BYTES)
    return max(allowance * files, int((policy_fraction if fraction is None else fraction) * asked))


def group_ranges(starts: np.ndarray, ends: np.ndarray, join: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranges ``[starts, ends)`` (sorted) with range ``k`` joined to ``k + 1`` where ``join[k]``."""
    first = np.concatenate([[0], np.flatnonzero(~join) + 1]).astype(np.int64)
    return starts[first], np.maximum.reduceat(ends, first)


def merge_run_arrays(
    starts: np.ndarray, lengths: np.ndarray, max_gap: int, max_extra: int
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~otfload.plan.boxes.merge_runs` on arrays of sorted, disjoint runs: the gaps are
    joined smallest first while each is at most ``max_gap`` and together at most ``max_extra``
    bytes; returns ``(starts, lengths)``."""
    if len(starts) < 2:
        return starts, lengths
    ends = starts + lengths
    gaps = starts[1:] - ends[:-1]
    order = np.argsort(gaps, kind="stable")
    spent = np.cumsum(gaps[order])
    take = int(np.searchsorted((gaps[order] > max_gap) | (spent > max_extra), True))  # a prefix: gaps ascend
    join = np.zeros(len(gaps), bool)
    join[order[:take]] = True
    s, e = group_ranges(starts, ends, join)
    return s, e - s


def coalesced_extents(
    starts: np.ndarray, lengths: np.ndarray, fraction: float = MAX_GAP_FRACTION, allowance: int = GAP_ALLOWANCE_BYTES
) -> tuple[np.ndarray, np.ndarray, int]:
    """What :func:`coalesce` fetches under ``gap_policy(fraction, allowance)`` for sorted, disjoint
    reads of one file: ``(starts, lengths, requests)`` — to plan what a remote source will fetch."""
    asked = int(lengths.sum())
    budget = max(allowance, int(fraction * asked))
    starts, lengths = merge_run_arrays(starts, lengths, REMOTE_REQUEST_GAP_BYTES, budget)
    return starts, lengths, int((-(-lengths // remote_chunk_bytes(asked))).sum())  # remote sources' request size


def _joinable(segments: list[tuple[str, int, memoryview]], gap: int, budget: int) -> set[int]:
    """Indices ``i`` whose hole to segment ``i + 1`` is read: the smallest holes first, each at most
    ``gap``, all together at most ``budget`` (overlaps and touching segments always join)."""
    holes: list[tuple[int, int]] = []
    ends: dict[str, int] = {}
    for i in range(len(segments) - 1):
        file, start, out = segments[i]
        ends[file] = max(ends.get(file, start), start + len(out))
        nxt = segments[i + 1]
        if nxt[0] == file:
            holes.append((max(0, nxt[1] - ends[file]), i))
    joined, spent = set(), 0
    for hole, i in sorted(holes):
        if hole > gap or spent + hole > budget:
            break
        joined.add(i)
        spent += hole
    return joined


def coalesce(
    reads: Sequence[RangeRead],
    gap: int = REMOTE_REQUEST_GAP_BYTES,
    max_run: int = MAX_RUN_BYTES,
    max_gap_fraction: float | None = None,
) -> list[Run]:
    """Group ``reads`` into runs: same file, holes of at most ``gap`` bytes, at most ``max_run`` bytes each.

    Holes are read smallest first, together at most ``max_gap_fraction`` of the bytes asked for (or
    GAP_ALLOWANCE_BYTES per file; both as :func:`gap_policy` says, if a caller set one). Reads longer
    than ``max_run`` are split first; overlapping reads share a run. Empty reads vanish.
    """
    segments = sorted(
        ((r.file, start, out) for r in reads for start, out in _split(r, max_run)), key=lambda s: (s[0], s[1])
    )
    asked = sum(len(out) for _, _, out in segments)
    joined = _joinable(segments, gap, _gap_budget(asked, len({f for f, _, _ in segments}), max_gap_fraction))
    runs: list[Run] = []
    file: str | None = None
    start, end = 0, 0
    pieces: list[Piece] = []
    for k, (seg_file, seg_start, out) in enumerate(segments):
        seg_end = seg_start + len(out)
        near = seg_start <= end or (k - 1) in joined
        if seg_file == file and near and max(end, seg_end) - start <= max_run:
            end = max(end, seg_end)
        else:
            if file is not None:
                runs.append(Run(file, start, end, tuple(pieces)))
            file, start, end, pieces = seg_file, seg_start, seg_end, []
        pieces.append(Piece(seg_start - start, out))
    if file is not None:
        runs.append(Run(file, start, end, tuple(pieces)))
    return runs


def _fetch_run(run: Run, fetch_into: FetchInto) -> None:
    if run.direct:
        with fetching(run.end - run.start):
            fetch_into(run.file, run.start, run.pieces[0].out)
        return
    buf = memoryview(bytearray(run.end - run.start))
    with fetching(run.end - run.start):
        fetch_into(run.file, run.start, buf)
    for p in run.pieces:
        p.out[:] = buf[p.at : p.at + len(p.out)]


def _fetch_threads() -> ThreadPoolExecutor:
    """The process's fetch threads, made on first use (and again in a forked child)."""
    global _FETCHERS
    with _FETCHERS_LOCK:
        if _FETCHERS is None:
            _FETCHERS = ThreadPoolExecutor(FETCH_THREADS, thread_name_prefix="otfload-read")
        return _FETCHERS


def _forget_fetch_threads() -> None:
    global _FETCHERS, _FETCHERS_LOCK
    _FETCHERS, _FETCHERS_LOCK = None, threading.Lock()  # the parent's threads do not exist in a child


os.register_at_fork(after_in_child=_forget_fetch_threads)


def read_runs(runs: Sequence[Run], fetch_into: FetchInto, max_workers: int = MAX_CONCURRENT_READS) -> None:
    """Fetch every run with ``fetch_into(file, offset, buffer)``, at most ``max_workers`` at a time.

    Runs go to the process's shared fetch threads (a run's fetch that reads runs itself does so in
    its own thread, one at a time). The first failure stops the runs not yet started and interrupts
    the running ones (their retries stop and their requests are cut, see
    :class:`~otfload.sources.retry.CancelToken`); it is raised once they have ended. Work runs under
    the caller's cancel token, so a load cancelled from above stops here too.
    """
    if len(runs) <= 1 or max_workers <= 1 or _IN_FETCH_THREAD.active:
        for run in runs:
            _fetch_run(run, fetch_into)
        return
    token = CancelToken(current_token())
    meter = current_meter()  # the fetch threads count for the caller's load

    def fetch(run: Run) -> None:
        _IN_FETCH_THREAD.active = True
        try:
            if token.cancelled:  # a sibling failed while this one waited its turn
                raise LoadCancelled(f"{run.file}: cancelled, another read of this batch failed")
            with cancel_scope(token), metering(meter):
                _fetch_run(run, fetch_into)
        except BaseException:
            token.cancel()  # at once, before another run of the batch starts
            raise
        finally:
            _IN_FETCH_THREAD.active = False

    pool, queued = _fetch_threads(), list(reversed(runs))
    running: set[Future[None]] = set()
    failed: list[BaseException] = []
    try:
        while queued or running:
            while queued and len(running) < max_workers and not failed:
                running.add(pool.submit(fetch, queued.pop()))
            done, running = wait(running, return_when=FIRST_COMPLETED)
            failed += [e for f in done if (e := f.exception()) is not None]
            if failed:
                queued.clear()  # never started
                token.cancel()  # running ones stop
        if failed:
            failed.sort(key=lambda e: isinstance(e, LoadCancelled))  # a real failure first
            raise failed[0]
    finally:
        token.cancel()  # nothing is left running; detaches the token from its parent's work
        if running:  # interrupted from above (KeyboardInterrupt): the cancelled runs end by themselves
            wait(running)


class RangeAnswer(NamedTuple):
    """How to take the bytes asked for from an HTTP answer's body."""

    skip: int  # body bytes before the first wanted one (a 200 with the whole file)
    take: int  # wanted bytes in the body (fewer than asked when a server sends a shorter range)
    body_size: int  # bytes the body must have
    may_stop: bool  # the rest of the body may be left unread once ``take`` bytes are in


def check_range_answer(
    status: int, headers: Mapping[str, str], what: str, start: int, last: int, size: int
) -> RangeAnswer:
    """Check an answer to ``Range: bytes=start-last`` on a file of ``size`` bytes; ``headers`` is
    case-insensitive. Raises :class:`SourceProtocolError` (naming ``what``) for anything that could
    deliver other bytes than those asked for."""
    encoding = (headers.get("Content-Encoding") or "identity").strip().lower()
    if encoding != "identity":
        raise SourceProtocolError(
            f"{what}: answered a byte range with Content-Encoding {encoding!r}; identity was asked, "
            "encoded bytes cannot be sliced"
        )
    length_text = headers.get("Content-Length")
    length = None
    if length_text is not None:
        if not length_text.strip().isdigit():
            raise SourceProtocolError(f"{what}: Content-Length {length_text!r} is not a byte count")
        length = int(length_text)
    if status == 200:  # the Range header was ignored: the body is the whole file
        if length is not None and length != size:
            raise SourceProtocolError(f"{what}: answered a byte range with 200 and {length} bytes, the file has {size}")
        if start > MAX_SKIP_BYTES:
            raise SourceProtocolError(
                f"{what}: the server ignores Range requests (200 with the whole file for bytes {start}-{last})"
            )
        return RangeAnswer(start, last - start + 1, size, length is not None)
    if status != 206:
        raise SourceProtocolError(f"{what}: unexpected HTTP {status} for a byte range")
    header = headers.get("Content-Range")
    m = _CONTENT_RANGE.fullmatch((header or "").strip())
    if m is None:
        raise SourceProtocolError(f"{what}: 206 with Content-Range {header!r}, expected 'bytes {start}-{last}/{size}'")
    first, end, total = int(m[1]), int(m[2]), m[3]
    if total != "*" and int(total) != size:
        raise SourceProtocolError(f"{what}: Content-Range {header!r} says the file has {total} bytes, not {size}")
    if first != start or end < first or end > last:
        raise SourceProtocolError(f"{what}: asked for bytes {start}-{last}, Content-Range says {header!r}")
    if length is not None and length != end - first + 1:
        raise SourceProtocolError(f"{what}: Content-Length {length} does not match Content-Range {header!r}")
    return RangeAnswer(0, end - first + 1, end - first + 1, False)


class RangeSink:
    """Copies the wanted bytes of a checked answer's body, chunk by chunk, into ``out[done:]``."""

    def __init__(self, answer: RangeAnswer, out: memoryview, done: int, what: str):
        self.answer, self.out, self.done, self.what = answer, out, done, what
        self.seen = 0  # body bytes received

    def feed(self, chunk: bytes | memoryview) -> bool:
        """Take ``chunk``; True once the rest of the body may be left unread."""
        view, (skip, take, body_size, may_stop) = memoryview(chunk), self.answer
        lo, hi = max(skip, self.seen) - self.seen, min(skip + take, self.seen + len(view)) - self.seen
        if lo < hi:
            self.out[self.done : self.done + hi - lo] = view[lo:hi]
            self.done += hi - lo
        self.seen += len(view)
        if self.seen > body_size:
            raise SourceProtocolError(f"{self.what}: the body is longer than the {body_size} bytes announced")
        return may_stop and self.seen >= skip + take

    def drain(self, readinto: Callable[[memoryview], int], piece: int) -> None:
        """Read the body through ``readinto`` (0 at its end), ``piece`` bytes at most per call: the
        wanted bytes straight into ``out``, skipped and trailing ones into one scratch piece.
        Stops at the body's end, or once the wanted bytes are in when the rest may be left unread."""
        skip, take, body_size, may_stop = self.answer
        scratch: memoryview | None = None
        while not (may_stop and self.seen >= skip + take):
            if skip <= self.seen < skip + take:
                got = readinto(self.out[self.done : self.done + min(piece, skip + take - self.seen)])
                self.done += got
            else:  # before the wanted bytes (a 200's head), or after them: the rest, and one byte more is an error
                n = min(piece, skip - self.seen if self.seen < skip else body_size - self.seen + 1)
                scratch = scratch if scratch is not None and len(scratch) >= n else memoryview(bytearray(n))
                got = readinto(scratch[:n])
            if got == 0:
                return
            self.seen += got
            if self.seen > body_size:
                raise SourceProtocolError(f"{self.what}: the body is longer than the {body_size} bytes announced")

    def finish(self) -> None:
        """The body ended: a short one is worth a retry (what arrived is kept)."""
        if self.seen < self.answer.body_size and not (self.answer.may_stop and self.seen >= sum(self.answer[:2])):
            raise TransientError(f"response body ended after {self.seen} of {self.answer.body_size} bytes")


def read_chunked(reads: Sequence[RangeRead], fetch_into: FetchInto, largest_chunk: int, max_in_flight: int) -> None:
    """Read ``reads`` from a remote source: coalesced into runs of at most
    ``remote_chunk_bytes(total, largest_chunk)`` bytes (so even one range splits into READ_SPLIT
    requests), at most ``max_in_flight`` of them at once."""
    chunk = remote_chunk_bytes(sum(r.out.nbytes for r in reads), largest_chunk)
    read_runs(coalesce(reads, max_run=chunk), fetch_into, max_workers=max_in_flight)
