"""Which bytes of a local file are in the page cache, and how to read a range given that.

``mincore(2)`` on a read-only mapping of the file reports, one byte per page, whether each page is
resident; it does no I/O and costs ~0.1 µs per page (measured: 33 ms for a 1.1 GB checkpoint), so a
tensor's range is probed exactly and a whole file from a sample of its pages. Where it is
unavailable (a platform without it, a mapping that fails), the residency is unknown and callers read
as if the range were cold.

:func:`choose_strategy` is the cost model, a pure function of the measured residency and the range's
size (measured on this project's 2-vCPU VM, virtio disk, ``read_ahead_kb`` 8192; see
docs/benchmarks.md, "Cold page cache"):

* **warm** (almost every page resident): map and copy once from the page cache; any read-ahead is
  wasted system calls.
* **cold** (pages missing): announce the range ahead of the builders (``posix_fadvise(WILLNEED)`` from
  a read-ahead thread, :mod:`otfload.read.readahead`) so the disk works while the CPUs copy; a range
  too small to be worth a system call is left to the builder's own synchronous prefetch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import mmap
import os
from collections.abc import Callable

import numpy as np

from otfload.accounting.gaps import PAGE_BYTES
from otfload.errors import InvalidOptionError

# A range with at least this fraction of its pages resident counts as warm: the builder's own
# prefetch (fadvise + populate of exactly its pages) reads the few missing ones; announcing them from
# the read-ahead thread too would save at most 2 % of the range's disk time (a judgement, not tuned).
WARM_FRACTION = 0.98
# A whole file's cache state is estimated from this many evenly spaced windows of pages (a file
# dropped from the cache is cold everywhere; one read whole is warm everywhere) ...
SAMPLE_WINDOWS = 32
# ... of SAMPLE_PAGES pages in all: ~0.1 ms per file instead of ~30 ms per GB probed page by page.
SAMPLE_PAGES = 1024
# Below this many missing bytes a range is never announced ahead: a system call (~5 µs with the
# mincore before it; an estimate) buys about what 64 KiB takes to arrive from this VM's disk (cold
# `cat` 1.9-2.1 GB/s, docs/benchmarks.md).
MIN_AHEAD_BYTES = 64 << 10


class Strategy(enum.Enum):
    """How a range is read, given its cache state."""

    MAP = "map"  # warm: copy straight from the mapped page cache, no read-ahead
    READ_AHEAD = "read-ahead"  # cold: fadvise(WILLNEED) ahead of use, then map and copy


def choose_strategy(resident_fraction: float | None, nbytes: int) -> Strategy:
    """The read strategy for a range of ``nbytes`` of which ``resident_fraction`` is in the page
    cache (None: unknown, read as cold)."""
    if nbytes <= 0:
        return Strategy.MAP
    if resident_fraction is None:
        return Strategy.READ_AHEAD if nbytes >= MIN_AHEAD_BYTES else Strategy.MAP
    if not 0.0 <= resident_fraction <= 1.0:
        raise InvalidOptionError(f"resident_fraction must be within [0, 1], got {resident_fraction!r}")
    missing = (1.0 - resident_fraction) * nbytes
    if resident_fraction >= WARM_FRACTION or missing < MIN_AHEAD_BYTES:
        return Strategy.MAP
    return Strategy.READ_AHEAD


# libc's ``mincore(addr, length, vec)``: 0 on success.
Mincore = Callable[[ctypes.c_void_p, int, int], int]


def _load_mincore() -> Mincore | None:
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name, use_errno=True)
        fn = libc.mincore
    except (OSError, AttributeError):
        return None
    fn.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    fn.restype = ctypes.c_int
    return fn


_MINCORE = _load_mincore()


def resident_pages(region: mmap.mmap, offset: int, length: int) -> np.ndarray | None:
    """One boolean per page of ``[offset, offset + length)`` of the mapped file: resident or not.

    None when the residency cannot be known (no ``mincore``, the range is outside the mapping, or
    the call fails).
    """
    if _MINCORE is None or length <= 0 or offset < 0 or offset + length > len(region):
        return None
    start = offset - offset % PAGE_BYTES
    pages = -(-(offset + length - start) // PAGE_BYTES)
    vec = np.zeros(pages, np.uint8)
    base = np.frombuffer(region, np.uint8).ctypes.data  # a read-only mapping: numpy lends its address
    if _MINCORE(ctypes.c_void_p(base + start), pages * PAGE_BYTES, vec.ctypes.data) != 0:
        return None
    return (vec & 1).astype(bool)


def resident_fraction(region: mmap.mmap, offset: int, length: int, max_pages: int | None = None) -> float | None:
    """The fraction of the pages of ``[offset, offset + length)`` in the page cache (None: unknown).

    With ``max_pages``, a longer range is estimated from SAMPLE_WINDOWS evenly spaced windows
    holding ``max_pages`` pages in all (mincore costs ~0.1 µs per page: 30 ms for a whole GB).
    """
    windows = SAMPLE_WINDOWS
    if max_pages is not None and length > max_pages * PAGE_BYTES and max_pages >= windows:
        window = (max_pages // windows) * PAGE_BYTES
        step = (length - window) // (windows - 1)
        found = [resident_pages(region, offset + i * step, window) for i in range(windows)]
        sampled = [f for f in found if f is not None]
        if len(sampled) < len(found):
            return None
        return float(np.concatenate(sampled).mean())
    pages = resident_pages(region, offset, length)
    if pages is None:
        return None
    return float(pages.mean()) if len(pages) else 1.0


def file_resident_fraction(
    path: str | os.PathLike[str], offset: int = 0, length: int | None = None
) -> float | None:
    """:func:`resident_fraction` of a range of the file at ``path`` (the whole file by default)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return 1.0
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as region:
            return resident_fraction(region, offset, size - offset if length is None else length)
