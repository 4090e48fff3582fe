"""A leaf's bytes: the boxes its devices hold and the source bytes they need — from the plan alone.

One count answers every "how many bytes" question, for the builder, the read-ahead, the read-layout
chooser, ``otfload inspect``, the benchmarks and the bytes-per-process tests alike:

* :func:`device_boxes` — the distinct boxes of a leaf on a set of devices (default: this process's),
  under its own sharding or a read layout chosen for it (devices with equal boxes share one build);
* :func:`leaf_reads` — those boxes carried back through the hooks: the bounding box of each HF
  tensor, the *selection* inside it (widening hooks leave holes) and which stacked tensors are read;
* :func:`needed_bytes` / :func:`leaf_needed` — the stored bytes of the selected elements (every
  part of a quantized or adapted tensor), without the pages, gaps or whole boxes a source fetches
  around them: exact however fragmented the selection (a stride-2 slice of GPT-OSS's interleaved
  ``gate_up_proj`` needs every other row, and counts every other row);
* :func:`leaf_ideal` — the source bytes of the elements the devices hold, each distinct shard once:
  what no reader can go below;
* :func:`device_bytes` — the device memory a leaf takes, per device (:func:`shard_bytes`, its
  largest; :func:`placed_per_device`, summed over leaves; the replicated-leaves warning), and
  :func:`held_bytes`, its distinct shards on a set of devices (what a reshard delivers to them).

What a *reader* fetches for those bytes (pages, merged gaps, requests) depends on the source and
lives with the reader (:meth:`~otfload.read.reader.TensorReader.planned`). The one reading decision
made here is which selections are worth reading piece by piece (:func:`useful_selection`): a
selection too fragmented to read apart is read, and fetched, as its bounding box (what it *needs*
stays the selection).

A derived tensor's selection reaches its stored parts axis by axis (:func:`part_selections`): each
part axis follows one axis of the tensor (MXFP4 codes: ``out`` → rows, ``in`` → 16-byte groups;
scale grids, packed words and LoRA factors alike), so each interval of each axis is mapped once —
a sum over the axes' intervals, not a product (2,880 strided columns × the other axes' intervals).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol, cast

import jax
import numpy as np

from otfload.index.derived import DerivedTensor, is_derived
from otfload.index.header import TensorInfo
from otfload.plan.abstract import AbstractLeaf
from otfload.plan.boxes import (
    Box,
    Selection,
    box_from_index,
    box_nbytes,
    box_selection,
    box_shape,
    box_size,
    merge_intervals,
    selection_boxes,
    selection_run_count,
    selection_size,
    selection_union,
)
from otfload.plan.hooks import Hook, Shape, chain_needed, chain_selection

# A selection (a box with holes, see Hook.selection) of more runs than this is read as its bounding
# box: per-element patterns (a stride-2 slice of the innermost axis) are cheaper read whole.
MAX_SELECTION_RUNS = 1 << 16
# ... and so is one whose runs average fewer bytes than this: each run costs a request (a preadv of
# ~1 µs, a range entry remotely), more than reading a hole this small (~0.03 µs at 10 GB/s) — below it
# only reading the box once and sharing it would help (a stride-2 slice of bf16 pairs: 2-byte runs).
MIN_SELECTION_RUN_BYTES = 256
# A derived tensor whose part axes do not each follow one axis of it (none in otfload: a guard for
# other DerivedTensor types) has its selection carried to its parts box by box, up to this many boxes.
MAX_DERIVED_SELECTION_BOXES = 4096
# Derived-tensor selections whose part selections are kept (a leaf's stacked tensors, sampled
# processes and candidate read layouts: a few hundred per plan; each a few KB of intervals).
AXIS_MAP_CACHE_SIZE = 1024
# Distinct (shape, sharding) pairs whose device -> index maps are kept: an unscanned 671B model has
# ~1,200 leaves of a few dozen distinct shapes; at 2,048 devices each map is ~100 KB.
INDEX_MAP_CACHE_SIZE = 256
# Boxes carried back through a leaf's hooks, kept by geometry (hooks, shapes, boxes): the same leaf
# of every layer of an unscanned tree, the report's recount after the load and the read-ahead all
# ask again (the 1 GiB unscanned Llama: 165 leaves of 10 geometries).
REGION_CACHE_SIZE = 4096

Devices = Iterable[jax.Device]


class LeafSources(Protocol):
    """What the counts read of a leaf's plan (:class:`~otfload.plan.planner.LeafPlan`, which calls
    them: the planner imports this module, not the other way round)."""

    @property
    def leaf(self) -> AbstractLeaf: ...
    @property
    def stack_axes(self) -> tuple[str, ...]: ...
    @property
    def stack_shape(self) -> tuple[int, ...]: ...
    @property
    def sources(self) -> tuple[TensorInfo | DerivedTensor, ...]: ...
    @property
    def hooks(self) -> tuple[Hook, ...]: ...
    @property
    def shapes(self) -> tuple[Shape, ...]: ...
    @property
    def source_bytes(self) -> int: ...


def bounding_box(boxes: Sequence[Box]) -> Box:
    """The smallest box holding every one of ``boxes`` (all of one rank)."""
    return tuple((min(d[0] for d in dims), max(d[1] for d in dims)) for dims in zip(*boxes, strict=True))


def device_boxes(leaf: AbstractLeaf, sharding: jax.sharding.Sharding | None = None,
                 devices: Devices | None = None) -> list[Box]:
    """The distinct boxes of ``leaf`` on ``devices`` (default: this process's) under ``sharding``
    (default: the leaf's own), in device order."""
    sharding = leaf.sharding if sharding is None else sharding
    key = (leaf.shape, sharding, None if devices is None else tuple(devices))
    return list(_device_boxes(*key))


@functools.lru_cache(maxsize=INDEX_MAP_CACHE_SIZE)  # the same shape and sharding in every layer
def addressable_boxes(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> tuple[tuple[jax.Device, Box], ...]:
    """``(device, box)`` of every device of this process under ``sharding``, in the sharding's order."""
    index_map = sharding.addressable_devices_indices_map(shape)
    return tuple((device, box_from_index(index, shape)) for device, index in index_map.items() if index is not None)


@functools.lru_cache(maxsize=INDEX_MAP_CACHE_SIZE)
def _device_boxes(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, devices: tuple[jax.Device, ...] | None
) -> tuple[Box, ...]:
    if devices is None:
        return tuple(dict.fromkeys(box for _, box in addressable_boxes(shape, sharding)))
    wanted = set(devices)
    index_map = {d: i for d, i in _indices_map(shape, sharding).items() if d in wanted}
    return tuple(dict.fromkeys(box_from_index(index, shape) for index in index_map.values() if index is not None))


def useful_selection(info: TensorInfo | DerivedTensor, box: Box, selection: Selection | None) -> Selection | None:
    """``selection`` unless it is the whole box or too fragmented to read piece by piece (None: read
    the whole box)."""
    if selection is None or selection == box_selection(box):
        return None
    if is_derived(info):
        return selection if _axis_map(info, box, selection) is not None or \
            math.prod(len(spans) for spans in selection) <= MAX_DERIVED_SELECTION_BOXES else None
    runs = selection_run_count(selection, info.shape)
    if runs > MAX_SELECTION_RUNS or selection_size(selection) * info.dtype.itemsize < MIN_SELECTION_RUN_BYTES * runs:
        return None
    return selection


def _axis_map(info: DerivedTensor, box: Box, selection: Selection) -> dict[str, Selection] | None:
    """:func:`_carry_axes`, remembered: a read asks it for the same selection several times (is it
    worth reading apart, the parts' selections, their siblings')."""
    try:
        return _carry_axes_cached(info, box, selection)
    except TypeError:  # a derived tensor that cannot be hashed
        return _carry_axes(info, box, selection)


def _carry_axes(info: DerivedTensor, box: Box, selection: Selection) -> dict[str, Selection] | None:
    """Each part's selection, carried axis by axis: every interval of axis ``d`` of ``selection``
    (the other axes at ``box``'s bounds) gives the part boxes' spans on the part axes that follow
    ``d``. None when a part axis moves with two axes of ``info`` (then it is not separable)."""
    parts = info.part_boxes(box)
    spans = {role: [[span] for span in pbox] for role, (_, pbox) in parts.items()}
    owner: dict[tuple[str, int], int] = {}
    for d, intervals in enumerate(selection):
        if intervals == (box[d],):
            continue
        moved = [info.part_boxes((*box[:d], interval, *box[d + 1 :])) for interval in intervals]
        for role, (_, pbox) in parts.items():
            for k, bound in enumerate(pbox):
                got = [m[role][1][k] for m in moved]
                if any(span != bound for span in got):
                    if owner.setdefault((role, k), d) != d:
                        return None
                    spans[role][k] = got
    return {role: tuple(merge_intervals(axis) for axis in per_axis) for role, per_axis in spans.items()}


_carry_axes_cached = cast(Callable[[DerivedTensor, Box, Selection], "dict[str, Selection] | None"],
                          functools.lru_cache(maxsize=AXIS_MAP_CACHE_SIZE)(_carry_axes))


def part_selections(
    info: DerivedTensor, box: Box, selection: Selection
) -> dict[str, tuple[TensorInfo | DerivedTensor, Box, Selection]]:
    """``{role: (part, part box, part selection)}`` of a derived tensor: each part's selection is the
    union of the part boxes of the selection's boxes (carried axis by axis, see the module doc)."""
    parts = info.part_boxes(box)
    carried = _axis_map(info, box, selection)
    if carried is None:
        boxes = [info.part_boxes(b) for b in selection_boxes(selection)]
        carried = {role: selection_union([box_selection(p[role][1]) for p in boxes]) for role in parts}
    return {role: (part, pbox, carried[role]) for role, (part, pbox) in parts.items()}


def stored_box_bytes(info: TensorInfo | DerivedTensor, box: Box) -> int:
    """Stored bytes a read of ``box`` of ``info`` needs (for a derived tensor: every part's box)."""
    if is_derived(info):
        return sum(stored_box_bytes(part, pbox) for part, pbox in info.part_boxes(box).values())
    return box_nbytes(box, info.dtype.itemsize)


def needed_bytes(info: TensorInfo | DerivedTensor, box: Box, selection: Selection | None = None) -> int:
    """Stored bytes a read of ``box`` (``selection`` in it) of ``info`` needs: exactly the selected
    elements (however fragmented), every part of a derived tensor (the part elements covering them)
    — without the pages, gaps or whole boxes a source fetches around them."""
    if selection is not None and selection == box_selection(box):
        selection = None
    if is_derived(info):
        if selection is not None and _axis_map(info, box, selection) is None:
            selection = useful_selection(info, box, selection)  # not separable: box by box, or whole
        if selection is None:
            return stored_box_bytes(info, box)
        parts = part_selections(info, box, selection).values()
        return sum(needed_bytes(part, pbox, psel) for part, pbox, psel in parts)
    return (selection_size(selection) if selection is not None else math.prod(box_shape(box))) * info.dtype.itemsize


def _inner_boxes(plan: LeafSources, boxes: Sequence[Box]) -> list[Box]:
    """The distinct boxes of one stacked slice (the stack dims dropped) among ``boxes``."""
    n = len(plan.stack_axes)
    return list(dict.fromkeys(box[n:] for box in boxes))


def _carried_back(
    hooks: tuple[Hook, ...], shapes: tuple[Shape, ...], inner: tuple[Box, ...], siblings: bool
) -> tuple[Box, Selection]:
    """The bounding box of ``inner`` carried back through ``hooks``, and the selection inside it
    (with ``siblings``: sibling leaves' elements too, see :func:`leaf_sibling_selection`)."""
    union = bounding_box([chain_needed(hooks, shapes, box) for box in inner])
    return union, selection_union([chain_selection(hooks, shapes, box, siblings) for box in inner])


_carried_back_cached = functools.lru_cache(maxsize=REGION_CACHE_SIZE)(_carried_back)


def _region(plan: LeafSources, boxes: Sequence[Box], siblings: bool = False) -> tuple[Box, Selection]:
    key = (plan.hooks, plan.shapes, tuple(_inner_boxes(plan, boxes)), siblings)
    try:
        hash(key)
    except TypeError:  # a family's own hook with an unhashable field: carried every time
        return _carried_back(*key)
    return _carried_back_cached(*key)


def source_region(plan: LeafSources, boxes: Sequence[Box]) -> tuple[Box, Selection]:
    """The box of each source tensor that ``boxes`` of ``plan``'s leaf need (carried back through
    the hooks), and the selection inside it (widening hooks leave holes)."""
    return _region(plan, boxes)


def leaf_reads(plan: LeafSources, boxes: Sequence[Box]) -> tuple[Box, Selection, list[int]]:
    """What the builder reads for ``boxes`` of ``plan``'s leaf: :func:`source_region`, and the
    indices of the stacked source tensors read (row-major)."""
    n = len(plan.stack_axes)
    union, selection = source_region(plan, boxes)
    if not n:
        return union, selection, [0]
    flat = [np.ravel_multi_index(np.ix_(*(np.arange(a, b) for a, b in stack)), plan.stack_shape).ravel()
            for stack in dict.fromkeys(box[:n] for box in boxes)]
    return union, selection, [int(i) for i in np.unique(np.concatenate(flat))]


def leaf_sibling_selection(plan: LeafSources, boxes: Sequence[Box]) -> Selection:
    """The elements of each source tensor that ``boxes`` of ``plan``'s leaf and its sibling leaves
    (the other offsets of a strided slice) read — :func:`leaf_reads`' selection and its holes that
    those siblings fill, on the same pages (up to one stride past the union box)."""
    return _region(plan, boxes, siblings=True)[1]


def leaf_needed(plan: LeafSources, boxes: Sequence[Box]) -> int:
    """Stored bytes of the source elements ``boxes`` of ``plan``'s leaf need (each HF tensor once),
    without pages or gaps."""
    if not boxes or not plan.sources:
        return 0
    union, selection, indices = leaf_reads(plan, boxes)
    return sum(needed_bytes(plan.sources[i], union, selection) for i in indices)


def leaf_ideal(plan: LeafSources, devices: Devices | None = None) -> int:
    """Source bytes of the elements of ``plan``'s leaf that ``devices`` hold, each distinct shard once."""
    if not plan.sources:
        return 0
    held = sum(box_size(box) for box in device_boxes(plan.leaf, None, devices))
    source_elements = len(plan.sources) * math.prod(plan.shapes[0])
    return plan.source_bytes * held // source_elements if source_elements else 0


@functools.lru_cache(maxsize=INDEX_MAP_CACHE_SIZE)
def _indices_map(shape: tuple[int, ...], sharding: jax.sharding.Sharding) -> Mapping[jax.Device, tuple[slice, ...]]:
    return sharding.devices_indices_map(shape)


def device_bytes(leaf: AbstractLeaf) -> dict[jax.Device, int]:
    """Bytes of ``leaf`` each device of its sharding holds, in its dtype (a replicated leaf: all of
    it on each) — the one count of a leaf's device memory."""
    return {device: box_nbytes(box_from_index(index, leaf.shape), leaf.dtype.itemsize)
            for device, index in _indices_map(tuple(leaf.shape), leaf.sharding).items()}


def held_bytes(leaf: AbstractLeaf, devices: Devices | None = None) -> int:
    """Bytes of the distinct shards of ``leaf`` that ``devices`` (default: this process's) hold, each
    once, in its dtype."""
    return sum(box_nbytes(box, leaf.dtype.itemsize) for box in device_boxes(leaf, None, devices))


def shard_bytes(leaf: AbstractLeaf) -> int:
    """Bytes of ``leaf``'s largest device shard, in its dtype (what one device holds of it)."""
    return max(device_bytes(leaf).values())


def placed_per_device(leaves: Iterable[AbstractLeaf]) -> dict[int, int]:
    """Bytes each device (by id) holds once every one of ``leaves`` is placed."""
    out: dict[int, int] = {}
    for leaf in leaves:
        for device, nbytes in device_bytes(leaf).items():
            out[device.id] = out.get(device.id, 0) + nbytes
    return dict(sorted(out.items()))
