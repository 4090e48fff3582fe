"""How many requests a remote read takes: the request size, and the prediction of a batch's fetch.

A remote source (Hub, fsspec) fetches a batch of ranges of one file as runs: the ranges merged
across the gaps :func:`~otfload.accounting.gaps.joined_gaps` reads, each run cut into requests of
:func:`remote_chunk_bytes`. :func:`remote_fetch` computes that from the ranges alone, for the plan
(``otfload inspect``, the load report, the read-layout chooser); the source's
:func:`~otfload.sources.runs.coalesce` applies the same rule to the real reads.
"""

from __future__ import annotations

import numpy as np

from otfload.accounting.gaps import DEFAULT_GAPS, REMOTE_REQUEST_GAP_BYTES, GapPolicy, gap_budget, merge_run_arrays

# A large range is fetched as concurrent chunks of this size straight into the caller's buffer
# (issue 20). At a 50 MB/s stream with a 20 ms round trip a chunk takes ~170 ms, so latency costs
# <= 11% per stream, while a 64 MiB leaf still spreads over 8 streams; measured on the shaped test
# Hub (docs/benchmarks_remote.md), 8 MiB fills the link as 16 and 32 MiB do.
REMOTE_CHUNK_BYTES = 8 << 20
# ... and a smaller read is still split in up to this many pieces of at least MIN_CHUNK_BYTES: a
# stacked leaf reads its layers one after another, so one layer's 6 MB read as one stream at 50 MB/s
# held a whole leaf to ~30 MB/s; in 4 pieces a 0.55 GB load from the shaped Hub took 2.8 s, not
# 3.9 s (8 pieces: 3.0 s, more requests for nothing; docs/benchmarks_remote.md).
READ_SPLIT = 4
# Below this a piece is worth less than its round trip (1 MiB takes 21 ms at 50 MB/s, a 20 ms RTT).
MIN_CHUNK_BYTES = 1 << 20


def remote_chunk_bytes(nbytes: int, largest: int = REMOTE_CHUNK_BYTES) -> int:
    """The request size for a remote read of ``nbytes``: READ_SPLIT pieces of at least
    MIN_CHUNK_BYTES, at most ``largest`` each."""
    return min(largest, max(MIN_CHUNK_BYTES, -(-nbytes // READ_SPLIT)))


def remote_fetch(
    starts: np.ndarray, lengths: np.ndarray, policy: GapPolicy = DEFAULT_GAPS
) -> tuple[np.ndarray, np.ndarray, int]:
    """What a remote source fetches for sorted, disjoint reads ``(starts, lengths)`` of one file
    under ``policy``: ``(starts, lengths, requests)`` of the merged runs."""
    asked = int(lengths.sum())
    starts, lengths = merge_run_arrays(starts, lengths, REMOTE_REQUEST_GAP_BYTES, gap_budget(asked, 1, policy))
    return starts, lengths, int((-(-lengths // remote_chunk_bytes(asked))).sum())
