"""Which gaps a fetch reads through: one rule for what the plan predicts and what the reads do.

A read asks a source for byte ranges of a file. Two ranges with a gap between them can be fetched
as two requests, or as one that reads the gap and throws it away. Reading a gap costs its bytes;
a request costs its round trip (a ~2 µs ``preadv`` or ``madvise`` locally, 5-50 ms remotely). The
rule, written once here (:func:`joined_gaps`) and used by every caller:

1. sort the gaps, smallest first;
2. read through them in that order while each is at most ``max_gap`` bytes (the limit: what one
   saved request is worth) and their sum stays within ``budget`` bytes (what the read may fetch
   beyond the bytes asked for);
3. stop at the first gap that breaks either bound: every larger gap is read apart too.

Touching or overlapping ranges (a gap of 0) always join. The budget is a fraction of the bytes
asked (:data:`MAX_GAP_FRACTION`), or a fixed allowance per file, whichever is more
(:func:`gap_budget`, :class:`GapPolicy`).

The callers: the local reader's page runs (:func:`page_run_arrays`, then :func:`merge_run_arrays`
with :data:`MAPPED_GAP_BYTES`), the plan's prediction of a remote source's requests
(:func:`otfload.accounting.requests.remote_fetch`) and a remote source's real requests
(:func:`otfload.sources.runs.coalesce`) — the last two with :data:`REMOTE_REQUEST_GAP_BYTES`, so
that what ``otfload inspect`` and the load report plan is what the source fetches.
"""

from __future__ import annotations

import mmap
from typing import NamedTuple

import numpy as np

# The kernel reads a mapped file in pages; a range's first and last pages are fetched whole.
PAGE_BYTES = mmap.PAGESIZE
# The gap *inside one tensor's box* that reading the box as one span (first element to last) may
# read per run it merges, instead of one read per run: a gap costs gap / ~10 GB/s, a separate read
# ~2 µs locally (a preadv), so ~20 KiB breaks even; 32 KiB.
BOX_SPAN_GAP_BYTES = 32 * 1024
# A mapped read merges page runs across gaps up to this size: one madvise call costs ~2 µs, about
# what 16 KiB of page cache or NVMe read-in costs.
MAPPED_GAP_BYTES = 16 * 1024
# The gap *between two ranges of one remote file* that one request may read through instead of
# making two requests: 1 MiB costs ~1 ms at 1 GB/s, less than one round trip (5-50 ms). Much larger
# than BOX_SPAN_GAP_BYTES, whose alternative is a ~2 µs local read, not a request.
REMOTE_REQUEST_GAP_BYTES = 1 << 20
# ... but the gaps a read fetches stay within this fraction of the bytes asked for: when a process
# needs a column block, the gaps are the other processes' columns, which it must not read (bytes
# per process ≈ its share; merging every gap below 1 MiB fetched 64 MiB for 2 MiB needed, issue 17).
MAX_GAP_FRACTION = 0.1
# ... or one gap's worth per file (at most one round trip's time), whichever is more, for a batch
# of remote reads nobody planned (a caller of ``Source.read_many``); a reader that planned its
# pieces allows none (:data:`PLANNED_GAPS`).
GAP_ALLOWANCE_BYTES = REMOTE_REQUEST_GAP_BYTES


class GapPolicy(NamedTuple):
    """How many gap bytes a batch of reads may fetch: ``fraction`` of the bytes asked, or
    ``allowance`` bytes per file read, whichever is more."""

    fraction: float
    allowance: int


# Reads handed to a source as they come: the fraction, or one gap's worth per file.
DEFAULT_GAPS = GapPolicy(MAX_GAP_FRACTION, GAP_ALLOWANCE_BYTES)
# Reads a TensorReader planned piece by piece: the gaps are others' bytes, only the fraction.
PLANNED_GAPS = GapPolicy(MAX_GAP_FRACTION, 0)


def gap_budget(asked: int, files: int, policy: GapPolicy) -> int:
    """Gap bytes a batch asking ``asked`` bytes of ``files`` files may read under ``policy``."""
    return max(policy.allowance * files, int(policy.fraction * asked))


def joined_gaps(gaps: np.ndarray, max_gap: int, budget: int) -> np.ndarray:
    """Which of ``gaps`` (bytes, each >= 0) are read through: the smallest first, each at most
    ``max_gap``, all of them together at most ``budget``; a boolean mask of ``gaps``' shape.

    Gaps of equal size are taken in their order. The taken gaps are a prefix of the sorted ones: the
    first gap past either bound ends the taking, so no larger gap is read while a smaller one is not.
    """
    order = np.argsort(gaps, kind="stable")
    ascending = gaps[order]
    take = int(np.searchsorted((ascending > max_gap) | (np.cumsum(ascending) > budget), True))
    joined = np.zeros(len(gaps), bool)
    joined[order[:take]] = True
    return joined


def group_ranges(starts: np.ndarray, ends: np.ndarray, join: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Ranges ``[starts, ends)`` (sorted by start) with range ``k`` joined to ``k + 1`` where
    ``join[k]``; returns the joined ``(starts, ends)``."""
    first = np.concatenate([[0], np.flatnonzero(~join) + 1]).astype(np.int64)
    return starts[first], np.maximum.reduceat(ends, first)


def merge_run_arrays(
    starts: np.ndarray, lengths: np.ndarray, max_gap: int, budget: int
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted, disjoint runs ``(starts, lengths)`` of one file merged across the gaps
    :func:`joined_gaps` reads; returns ``(starts, lengths)``."""
    if len(starts) < 2:
        return starts, lengths
    ends = starts + lengths
    s, e = group_ranges(starts, ends, joined_gaps(starts[1:] - ends[:-1], max_gap, budget))
    return s, e - s


def page_run_arrays(
    starts: np.ndarray, lengths: np.ndarray, base: int, limit: int, page: int = PAGE_BYTES
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted runs ``(starts, lengths)`` (relative to ``base``, a file offset) grown to whole pages
    of the file, clipped to ``[0, limit)`` and merged where they meet: the pages a read of a local
    file faults in. Returns ``(starts, lengths)``."""
    if len(starts) == 0:
        return starts, lengths
    s = np.maximum(0, (base + starts) // page * page - base)
    e = np.minimum(limit, -(-(base + starts + lengths) // page) * page - base)
    reach = np.maximum.accumulate(e)
    s, e = group_ranges(s, e, s[1:] <= reach[:-1])
    return s, e - s
