"""Boxes (rectangular index ranges) and the byte math that turns them into file reads.

A *box* is a tuple of half-open ``(start, stop)`` pairs, one per dimension: the part of a tensor a
device shard needs. These pure functions answer three questions the loader asks:

* which box does a device's ``index`` (tuple of slices from a sharding) select
  (:func:`box_from_index`);
* which contiguous byte runs of a row-major tensor hold a box (:func:`byte_runs`): the trailing
  dimensions the box covers fully form one block, so a box is ``prod(leading extents)`` runs of
  ``extent * block`` bytes, and adjacent runs are merged;
* how a flat row-major range maps to the smallest box covering it (:func:`cover_range`) — the
  step reshape hooks use to carry boxes across a reshape;
* which bytes a *selection* holds (:func:`selection_pieces`): a product of per-dimension interval
  lists, what a hook that widens a box (a head-interleaved reshape, a strided slice) really needs
  inside it — read exactly, into the layout of its bounding box.

Which ranges a reader fetches for those bytes (whole pages, gaps read through) is
:mod:`otfload.accounting.gaps`'s.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

Box = tuple[tuple[int, int], ...]
# Per dimension, sorted disjoint half-open intervals; the selected elements are their product.
Selection = tuple[tuple[tuple[int, int], ...], ...]


class ByteRun(NamedTuple):
    """``length`` bytes starting ``offset`` bytes into a tensor's data."""

    offset: int
    length: int


def full_box(shape: Sequence[int]) -> Box:
    return tuple((0, int(n)) for n in shape)


def box_shape(box: Box) -> tuple[int, ...]:
    return tuple([stop - start for start, stop in box])  # a list first: faster than a generator


def box_size(box: Box) -> int:
    return math.prod([stop - start for start, stop in box])  # called per tensor and box: kept lean


def is_full(box: Box, shape: Sequence[int]) -> bool:
    return box == full_box(shape)


def box_from_index(index: Sequence[slice], shape: Sequence[int]) -> Box:
    """The box of a sharding index (slices with step 1, as ``devices_indices_map`` returns)."""
    box = []
    for sl, n in zip(index, shape, strict=True):
        start, stop, step = sl.indices(n)
        if step != 1:
            raise ValueError(f"index {index} has a step; shard indices are contiguous")
        box.append((start, stop if stop > start else start))
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


# --- selections ------------------------------------------------------------------------------------


def box_selection(box: Box) -> Selection:
    """The selection of every element of ``box``."""
    return tuple((span,) for span in box)


def merge_intervals(spans: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Sorted, non-empty, with overlapping or touching intervals merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(s for s in spans if s[1] > s[0]):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return tuple(out)


def selection_bounds(selection: Selection) -> Box:
    """The bounding box of ``selection`` (``(0, 0)`` on a dimension that selects nothing)."""
    return tuple((spans[0][0], spans[-1][1]) if spans else (0, 0) for spans in selection)


def selection_size(selection: Selection) -> int:
    return math.prod(sum(b - a for a, b in spans) for spans in selection)


def selection_union(selections: Sequence[Selection]) -> Selection:
    """Per dimension, the union of the intervals: a selection covering every one of ``selections``."""
    return tuple(merge_intervals([s for spans in dims for s in spans]) for dims in zip(*selections, strict=True))


def selection_boxes(selection: Selection) -> list[Box]:
    """The boxes whose union is ``selection`` (one per combination of intervals)."""
    return [tuple(combo) for combo in itertools.product(*selection)]


def _contiguous_from(selection: Selection, shape: Sequence[int]) -> int:
    """The outermost dimension from which on ``selection`` is whole (so each run spans those dims)."""
    split = len(shape)
    while split > 0 and selection[split - 1] == ((0, shape[split - 1]),):
        split -= 1
    return split


def selection_run_count(selection: Selection, shape: Sequence[int]) -> int:
    """How many contiguous byte runs :func:`selection_pieces` returns at most (before merging)."""
    split = _contiguous_from(selection, shape)
    if split == 0:
        return 1 if selection_size(selection) else 0
    leading = math.prod(sum(b - a for a, b in spans) for spans in selection[: split - 1])
    return leading * len(selection[split - 1])


# Distinct (shape, itemsize, selection, box) whose pieces are kept: one region is costed, and read,
# for each stacked tensor in turn (a layer's fused experts, thousands of experts), with at most three
# selections at a time (the read's, the leaf's own and its siblings', reader._charged).
PIECES_CACHE_SIZE = 4


def selection_piece_arrays(
    shape: Sequence[int], itemsize: int, selection: Selection, box: Box
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """:func:`selection_pieces` as three int64 arrays (source offsets, box offsets, lengths),
    read-only: equal arguments in a row share them (the read-layout chooser costs one region of each
    of a leaf's stacked tensors in turn: Qwen3.5-35B-A3B's 30 fused expert tensors of a layer kind
    built the same pieces 4,000 times, 60 % of its plan's CPU at 256 devices)."""
    return _piece_arrays(tuple(shape), itemsize, selection, box)


@functools.lru_cache(maxsize=PIECES_CACHE_SIZE)
def _piece_arrays(
    shape: tuple[int, ...], itemsize: int, selection: Selection, box: Box
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    pieces = _build_piece_arrays(shape, itemsize, selection, box)
    for array in pieces:
        array.flags.writeable = False
    return pieces


def _build_piece_arrays(
    shape: Sequence[int], itemsize: int, selection: Selection, box: Box
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    empty = np.zeros(0, np.int64)
    if selection_size(selection) == 0:
        return empty, empty, empty
    ndim = len(shape)
    split = _contiguous_from(selection, shape)
    if split == 0:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([math.prod(shape) * itemsize], np.int64)
    strides = [math.prod(shape[d + 1 :]) * itemsize for d in range(ndim)]
    bshape = box_shape(box)
    bstrides = [math.prod(bshape[d + 1 :]) * itemsize for d in range(ndim)]
    src, dst = np.zeros(1, np.int64), np.zeros(1, np.int64)
    for d in range(split - 1):  # every index of the leading dims, row-major
        idx = np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in selection[d]])
        src = (src[:, None] + idx[None, :] * strides[d]).ravel()
        dst = (dst[:, None] + (idx[None, :] - box[d][0]) * bstrides[d]).ravel()
    spans = np.array(selection[split - 1], np.int64)
    src = (src[:, None] + spans[None, :, 0] * strides[split - 1]).ravel()
    dst = (dst[:, None] + (spans[None, :, 0] - box[split - 1][0]) * bstrides[split - 1]).ravel()
    length = np.broadcast_to((spans[:, 1] - spans[:, 0]) * strides[split - 1], (len(src) // len(spans), len(spans)))
    length = length.ravel().astype(np.int64)
    joins = (src[:-1] + length[:-1] == src[1:]) & (dst[:-1] + length[:-1] == dst[1:])
    first = np.concatenate([[0], np.flatnonzero(~joins) + 1])
    return src[first], dst[first], np.add.reduceat(length, first)


def selection_pieces(shape: Sequence[int], itemsize: int, selection: Selection, box: Box) -> list[tuple[int, int, int]]:
    """``(source offset, offset in box, length)`` in bytes of the contiguous runs holding ``selection``.

    Source offsets are relative to the tensor's first byte; box offsets to a dense row-major buffer
    of ``box`` (which must contain the selection). Runs adjacent on both sides are merged.
    """
    src, dst, length = selection_piece_arrays(shape, itemsize, selection, box)
    return list(zip(src.tolist(), dst.tolist(), length.tolist(), strict=True))
