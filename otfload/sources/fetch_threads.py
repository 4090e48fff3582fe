"""Fetching runs of a remote read in parallel, on threads the process makes once.

:func:`read_runs` fetches :class:`~otfload.sources.runs.Run` s with bounded concurrency and
scatters the bytes into the callers' buffers; the first failure cancels the rest. Every fetch is
recorded on the load's :class:`~otfload.accounting.meter.FetchMeter`. :func:`read_chunked` is a remote
source's ``read_many``: the reads coalesced under the gap rule its caller passed (``gaps``, see
:class:`~otfload.sources.base.GapReadingSource`), then fetched.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

from otfload.accounting.gaps import GapPolicy
from otfload.accounting.meter import fetching
from otfload.accounting.requests import remote_chunk_bytes
from otfload.errors import LoadCancelled
from otfload.sources.base import RangeRead
from otfload.sources.load_context import submit
from otfload.sources.retry import CancelToken, cancel_scope, current_token
from otfload.sources.runs import Run, coalesce

# Requests in flight per read_many: enough to hide object-store latency at ~1 GB/s with multi-MiB
# runs, few enough to stay under per-host connection limits and bound in-flight bytes
# (MAX_CONCURRENT_READS x MAX_RUN_BYTES).
MAX_CONCURRENT_READS = 16
# Threads fetching runs for every read_runs call of the process, made once: a pool per call cost a
# thread start per run (the loader's 8 builders read a stack chunk at a time), the largest user of
# the GIL in a Hub load after the HTTP client. Above the requests in flight of a few sources (each
# source bounds its own, MAX_REQUESTS_IN_FLIGHT); a batch queues behind the others past it.
FETCH_THREADS = 64
# Requests one remote source has in flight at once, over all its threads: 16 streams of >= 50 MB/s
# fill 800 MB/s; fewer than huggingface_hub's 20 kept-alive connections (more are closed after each
# request and re-opened: a TCP + TLS handshake, 2-3 round trips, on a real network); in-flight bytes
# stay <= 16 x 8 MiB for sources that stage a chunk (gcsfs returns each body as one bytes object).
MAX_REQUESTS_IN_FLIGHT = 16

_FETCHERS: ThreadPoolExecutor | None = None
_FETCHERS_LOCK = threading.Lock()


class _FetchThreadState(threading.local):
    active = False  # this thread is fetching a run now


_IN_FETCH_THREAD = _FetchThreadState()

FetchInto = Callable[[str, int, memoryview], None]


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
    token = CancelToken(current_token())  # the batch's: cancelled with the load, or by its first failure

    def fetch(run: Run) -> None:
        _IN_FETCH_THREAD.active = True
        try:
            if token.cancelled:  # a sibling failed while this one waited its turn
                raise LoadCancelled(f"{run.file}: cancelled, another read of this batch failed")
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
                with cancel_scope(token):  # each run in the caller's context (its meter), under the batch's token
                    running.add(submit(pool, fetch, queued.pop()))
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


def read_chunked(
    reads: Sequence[RangeRead], fetch_into: FetchInto, largest_chunk: int, max_in_flight: int, gaps: GapPolicy
) -> None:
    """Read ``reads`` from a remote source: coalesced under ``gaps`` (the rule the plan predicted
    the requests with, :func:`~otfload.accounting.requests.remote_fetch`) into runs of at most
    ``remote_chunk_bytes(total, largest_chunk)`` bytes (so even one range splits into READ_SPLIT
    requests), at most ``max_in_flight`` of them at once."""
    chunk = remote_chunk_bytes(sum(r.out.nbytes for r in reads), largest_chunk)
    read_runs(coalesce(reads, max_run=chunk, policy=gaps), fetch_into, max_workers=max_in_flight)
