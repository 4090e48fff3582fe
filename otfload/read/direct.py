"""``O_DIRECT`` reads of cold files, several in flight: a disk reaches its rate only so.

A builder used to read the runs of a chunk one ``preadv`` after another, each a tensor's run of
2-13 MB on the 1 GiB Llama: one request in flight per builder. Measured on this VM's disk (cold,
``O_DIRECT``): one stream of 8 MiB reads 0.72-1.42 GB/s, four threads of 8 MiB reads 1.32-1.76 GB/s
(issue 46's disk rate, its ``direct4`` baseline). :func:`read_all` reads every run a chunk needs in
pieces of at most :data:`PIECE_BYTES`, :data:`READS_IN_FLIGHT` at a time on threads the process
makes once, each piece in the context of the load it reads for (its meter counts the ``preadv``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import NamedTuple

from otfload.accounting.meter import expected_fetch, fetching
from otfload.errors import TruncatedFileError
from otfload.sources.base import DirectSource
from otfload.sources.load_context import submit

# Pieces of one read: a multiple of every block alignment (4 KiB), small enough that a chunk's runs
# become several requests, large enough that a request's fixed cost stays small.
PIECE_BYTES = 8 << 20
# Reads in flight over all builders: the disk rate was measured with 4.
READS_IN_FLIGHT = 4

_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()


class DirectRead(NamedTuple):
    """One block-aligned read of ``file`` at ``start`` into ``out``, of which the bytes from ``at``
    (a file offset) for ``needed`` bytes must be present. ``charge``: bytes it counts as fetched
    instead of what the source records (a share of pages sibling leaves read too), or None."""

    file: str
    start: int
    out: memoryview
    at: int
    needed: int
    charge: int | None = None


def _pool() -> ThreadPoolExecutor:
    """The process's direct-read threads, made on first use (and again in a forked child)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(READS_IN_FLIGHT, thread_name_prefix="otfload-direct")
        return _POOL


def _forget_pool() -> None:
    global _POOL, _POOL_LOCK
    _POOL, _POOL_LOCK = None, threading.Lock()  # the parent's threads do not exist in a child


os.register_at_fork(after_in_child=_forget_pool)


def _piece(source: DirectSource, read: DirectRead, offset: int, length: int) -> int:
    # A charged read counts its share once (with its first piece); any other, what the source records.
    counting = expected_fetch(length) if read.charge is None else fetching(read.charge if offset == 0 else 0)
    with counting:
        return source.read_direct_into(read.file, read.start + offset, read.out[offset : offset + length])


def read_all(source: DirectSource, reads: Sequence[DirectRead]) -> None:
    """Do ``reads``, in pieces, several at once; returns once every piece has ended (none writes into
    a buffer afterwards). A run the file no longer holds is a :class:`TruncatedFileError`."""
    jobs: list[tuple[DirectRead, list[tuple[int, Future[int]]]]] = []
    pool = _pool()
    for read in reads:
        pieces = []
        for offset in range(0, len(read.out), PIECE_BYTES):
            length = min(PIECE_BYTES, len(read.out) - offset)
            pieces.append((length, submit(pool, _piece, source, read, offset, length)))
        jobs.append((read, pieces))
    wait([f for _, pieces in jobs for _, f in pieces])
    for read, pieces in jobs:
        got = 0
        for length, future in pieces:
            n = future.result()  # the first failure is raised
            got += n
            if n < length:  # the file ends here
                break
        if got < read.at - read.start + read.needed:
            end = read.at + read.needed
            raise TruncatedFileError(read.file, f"needs bytes [{read.at}, {end}) but ends at {read.start + got}")
