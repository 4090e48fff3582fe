"""``madvise`` on mapped memory that lets other threads run meanwhile.

Python's ``mmap.madvise`` keeps the GIL for the whole call, and so does ``mmap.mmap(...,
MAP_POPULATE)``; building page tables for 100 MiB takes ~75 ms on this VM, during which no other
builder thread runs any Python (measured: a spinning thread got 25-30 % of its rate while one call
ran, 100-110 % while the same call went through ctypes). Loads spend a third of their CPU time
populating pages (the mapped file's, and every fresh shard buffer's), so with two builders the GIL
held there left one core idle half the time. ``ctypes`` releases the GIL around the foreign call.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
from collections.abc import Callable

import numpy as np

# Linux 5.14+: build the page tables of a range (reading file pages in / allocating and zeroing
# anonymous ones) in one call, instead of one fault per page. Older kernels answer EINVAL.
MADV_POPULATE_READ = 22
MADV_POPULATE_WRITE = 23


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    try:  # the symbols already loaded into the process (libc's among them): no library search at import
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError, TypeError):  # no madvise to call (Windows): mmap's own, GIL held
        return None
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    madvise: Callable[[int, int, int], int] = function
    return madvise


_MADVISE = _libc_madvise()


def madvise(region: mmap.mmap, start: int, length: int, advice: int) -> None:
    """``region.madvise(advice, start, length)`` (``start`` page-aligned; the range is clipped to the
    region, as ``mmap.madvise`` does), with the GIL released during the call.

    Raises ``ValueError`` for a closed region or a start outside it, ``OSError`` for what the kernel
    refuses (``EINVAL`` for an advice it does not know, ``EFAULT`` for pages beyond a truncated file).
    """
    if _MADVISE is None:
        region.madvise(advice, start, length)
        return
    size = len(region)  # ValueError when closed
    if not 0 <= start < size or length < 0:
        raise ValueError(f"madvise range [{start}, {start + length}) outside the {size}-byte mapping")
    length = min(length, size - start)
    if length == 0:
        return
    pinned = np.frombuffer(region, np.uint8)  # a view: the mapping cannot be unmapped during the call
    failed = _MADVISE(pinned.ctypes.data + start, length, advice) != 0
    code = ctypes.get_errno()
    del pinned  # before raising: a traceback keeping the view would keep the mapping from closing
    if failed:
        raise OSError(code, os.strerror(code))


def populate_write(region: mmap.mmap) -> None:
    """Allocate and zero every page of an anonymous mapping now (``MADV_POPULATE_WRITE``): one call
    instead of one fault per 4 KiB page while it is filled. Kernels before 5.14: the pages fault in
    as they are written."""
    try:
        madvise(region, 0, len(region), MADV_POPULATE_WRITE)
    except OSError as e:
        if e.errno != errno.EINVAL:
            raise


PAGE = mmap.PAGESIZE


def populate_pages(array: np.ndarray) -> None:
    """Populate the whole pages inside ``array``'s memory (C-contiguous) for writing at once
    (``MADV_POPULATE_WRITE``, the GIL released), as :func:`populate_write` does for a mapping; the
    partial pages at its ends fault in as they are written. Advisory: without the call (Windows,
    kernels before 5.14) the pages fault in as written."""
    start = -(-array.ctypes.data // PAGE) * PAGE
    end = (array.ctypes.data + array.nbytes) // PAGE * PAGE
    if _MADVISE is not None and end > start:
        _MADVISE(start, end - start, MADV_POPULATE_WRITE)
