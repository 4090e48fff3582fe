"""Remote request sizes and the prediction of a remote batch's fetch, from the ranges alone."""

from __future__ import annotations

import numpy as np

from otfload.accounting.gaps import PLANNED_GAPS, REMOTE_REQUEST_GAP_BYTES
from otfload.accounting.requests import (
    MIN_CHUNK_BYTES,
    READ_SPLIT,
    REMOTE_CHUNK_BYTES,
    remote_chunk_bytes,
    remote_fetch,
)

KIB, MIB = 1 << 10, 1 << 20


def test_a_read_is_cut_in_read_split_pieces_between_the_smallest_and_the_largest_chunk():
    assert remote_chunk_bytes(10 * KIB) == MIN_CHUNK_BYTES
    assert remote_chunk_bytes(6 * MIB) == 6 * MIB // READ_SPLIT
    assert remote_chunk_bytes(1 << 30) == REMOTE_CHUNK_BYTES
    assert remote_chunk_bytes(1 << 30, largest=2 * MIB) == 2 * MIB


def test_one_large_read_is_several_requests():
    starts, lengths, requests = remote_fetch(np.array([0]), np.array([20 * MIB]))
    assert (starts.tolist(), lengths.tolist(), requests) == ([0], [20 * MIB], READ_SPLIT)


def test_a_gap_joins_within_one_files_allowance_but_not_within_a_planned_fraction():
    starts, lengths = np.array([0, 2 * KIB + 100 * KIB]), np.array([2 * KIB, 2 * KIB])
    merged, merged_lengths, requests = remote_fetch(starts, lengths)
    assert (merged.tolist(), merged_lengths.tolist(), requests) == ([0], [104 * KIB], 1)
    merged, merged_lengths, requests = remote_fetch(starts, lengths, PLANNED_GAPS)
    assert (merged.tolist(), merged_lengths.tolist(), requests) == (starts.tolist(), lengths.tolist(), 2)


def test_a_gap_above_the_request_gap_is_never_read():
    starts, lengths = np.array([0, 2 * KIB + REMOTE_REQUEST_GAP_BYTES + 1]), np.array([2 * KIB, 2 * KIB])
    assert remote_fetch(starts, lengths)[2] == 2
