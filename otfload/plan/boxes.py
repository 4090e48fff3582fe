"""Boxes (rectangular index ranges) and the byte math that turns them into file reads.

A *box* is a tuple of half-open ``(start, stop)`` pairs, one per dimension: the part of a tensor a
device shard needs. These pure functions answer three questions the loader asks:

* which box does a device's ``index`` (tuple of slices from a sharding) select
  (:func:`box_from_index`);
* which contiguous byte runs of a row-major tensor hold a box (:func:`byte_runs`): the trailing
  dimensions the box covers fully form one block, so a box is ``prod(leading extents)`` runs of
  ``extent * block`` bytes, and adjacent runs are merged;
* how a flat row-major range maps to the smallest box covering it (:func:`cover_range`) — the
  step reshape hooks use to carry boxes across a reshape.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

Box = tuple[tuple[int, int], ...]


class ByteRun(NamedTuple):
    """``length`` bytes starting ``offset`` bytes into a tensor's data."""

    offset: int
    length: int


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple(stop - start for start, stop in box)


def box_size(box: Box) -> int:
    return math.prod(box_shape(box))


def is_full(box: Box, shape: Sequence[int]) -> bool:
    return box == full_box(shape)


def box_from_index(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """The box of a sharding index (slices with step 1, as ``devices_indices_map`` returns)."""
    box = []
    for sl, n in zip(index, shape, strict=True):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"index {index} has a step; shard indices are contiguous")
        box.append((start, max(start, stop)))
    return tuple(box)


def box_to_slices(box: Box) -> tuple[slice, ...]:
    return tuple(slice(start, stop) for start, stop in box)


def crop(array: np.ndarray, have: Box, want: Box) -> np.ndarray:
    """View of ``array`` (which holds box ``have``) restricted to ``want`` (inside ``have``)."""
    if have == want:
        return array
    return array[tuple(slice(w0 - h0, w1 - h0) for (h0, _), (w0, w1) in zip(have, want, strict=True))]


def byte_runs(shape: Sequence[int], itemsize: int, box: Box) -> list[ByteRun]:
    """Contiguous byte runs (relative to the tensor's first byte) that hold ``box``, merged."""
    if box_size(box) == 0:
        return []
    ndim = len(shape)
    # Find the outermost dimension from which on the box is one contiguous block.
    split = ndim
    while split > 0 and box[split - 1] == (0, shape[split - 1]):
        split -= 1
    if split == 0:
        return [ByteRun(0, math.prod(shape) * itemsize)]
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(ndim)]
    start, stop = box[split - 1]
    run_length = (stop - start) * strides[split - 1]
    leading = [range(b0, b1) for b0, b1 in box[: split - 1]]
    runs: list[ByteRun] = []
    for idx in itertools.product(*leading):
        offset = sum(i * s for i, s in zip(idx, strides, strict=False)) + start * strides[split - 1]
        if runs and runs[-1].offset + runs[-1].length == offset:
            runs[-1] = ByteRun(runs[-1].offset, runs[-1].length + run_length)
        else:
            runs.append(ByteRun(offset, run_length))
    return runs


def box_nbytes(box: Box, itemsize: int) -> int:
    return box_size(box) * itemsize


def flat_range(box: Box, shape: Sequence[int]) -> tuple[int, int]:
    """The smallest flat row-major range ``[lo, hi)`` containing every element of ``box``."""
    if box_size(box) == 0:
        return 0, 0
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    lo = sum(b0 * s for (b0, _), s in zip(box, strides, strict=True))
    hi = sum((b1 - 1) * s for (_, b1), s in zip(box, strides, strict=True)) + 1
    return lo, hi


def cover_range(lo: int, hi: int, shape: Sequence[int]) -> Box:
    """The smallest box of ``shape`` whose flat range contains ``[lo, hi)``.

    Leading dimensions are pinned to one index while the range stays inside one of their rows;
    the first dimension it spans is given its range and every later dimension is taken whole.
    """
    box: list[tuple[int, int]] = []
    for d in range(len(shape)):
        inner = math.prod(shape[d + 1 :])
        if inner == 0:
            return full_box(shape)
        first, last = lo // inner, (hi - 1) // inner
        if first == last and d < len(shape) - 1:
            box.append((first, first + 1))
            lo, hi = lo - first * inner, hi - first * inner
            continue
        box.append((first, last + 1))
        box.extend((0, m) for m in shape[d + 1 :])
        break
    return tuple(box)


def represents_range(box: Box, shape: Sequence[int]) -> bool:
    """Whether ``box`` holds exactly the elements of its flat range (no holes)."""
    lo, hi = flat_range(box, shape)
    return box_size(box) == hi - lo
