"""Build and place leaves: each device shard from exactly the bytes it needs, with one ``np.stack``.

For one leaf:

1. the sharding gives every local device a box of the leaf; devices with equal boxes (replicated
   dims) share one build;
2. a box's leading stack dims pick the HF tensors (layers, experts) it needs; the rest of the box
   is carried backwards through the hooks to the box of each HF tensor covering it
   (:func:`~otfload.plan.hooks.chain_needed`);
3. each HF tensor is read once per process — the bounding box of what the local devices need from
   it — into reusable scratch, so replicated and column-split shards never read a byte twice;
4. per device box, the pieces go forwards through the hooks (views where possible), are cropped,
   and one ``np.stack`` writes them, cast to the target dtype, into a fresh 64-byte-aligned buffer
   (populated up front, :func:`~otfload.read.arena.aligned_empty`) — the only full copy of the
   data — which JAX's CPU backend adopts without copying. Transposed pieces are copied by XLA's
   host transpose (:mod:`otfload.place.transpose`); an unstacked one's copy is the shard itself;
5. each leaf is placed with one call for all its device shards (:mod:`otfload.place.put`).

Accelerators (GPU, TPU) copy a host buffer into their own memory instead of adopting it, so for
them the host buffer is only staging: stacked and transposed shards are written into a per-thread
staging arena reused from leaf to leaf (pages already touched, no fresh mapping per leaf), and an
unstacked, contiguous piece of the target dtype goes to the device as it was read (a view of the
mapped file or of scratch): no host copy at all. Both stay alive until the device holds the leaf.
Where the staging buffers are registered for direct DMA (:mod:`otfload.read.pinned`), every shard is
written into them instead — the one host copy — and the device copies from there at the link's rate.

Scratch is bounded: stack slices are processed in chunks whose source bytes fit each thread's share
of ``budget`` (default: the largest leaf, so transient memory stays within one leaf; from mapped
files at most :data:`MAPPED_CHUNK_BYTES`, whose pages count in RSS until stacked), and a thread's
scratch shrinks back to its share after an oversized tensor. Each device gets its
own buffer, so no two devices alias memory a donating computation might overwrite.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable
from typing import TypeVar

import jax
import numpy as np

from otfload.pages import populate_pages
from otfload.place.device_hooks import Stacker, hooks_on_device, place_on_devices, raw_stacker
from otfload.place.put import place_shards
from otfload.place.transpose import copy_into, transposed_axis, xla_copies
from otfload.plan.boxes import Box, box_nbytes, box_shape, crop
from otfload.plan.hooks import chain_apply, chain_needed
from otfload.plan.leaf_bytes import addressable_boxes, leaf_sibling_selection, source_region
from otfload.plan.planner import LeafPlan
from otfload.read.arena import Arena, aligned_empty
from otfload.read.reader import TensorReader

# A chunk read from mapped files holds its pages in this process's RSS until the chunk is stacked;
# larger chunks buy nothing there (no requests to keep in flight together), so they stay small. On
# the 1 GiB Llama bench (2 builders, largest leaf 0.218 GiB) transient host memory was 0.111 / 0.123
# / 0.164 / 0.22 GiB with 16 / 32 / 64 MiB / uncapped chunks, at the same speed.
MAPPED_CHUNK_BYTES = 32 << 20

# Accelerators get stacked and transposed shards through a reused per-thread staging buffer, and
# contiguous unstacked ones as read (see the module docstring). False: a fresh buffer per shard, as
# for CPU devices. 4 GiB Llama onto an H200 (bench_load --platform gpu, medians of 3): 4.23 s and
# 10.5 GiB peak host memory with it, 4.48 s and 11.3 GiB without.
HOST_STAGING = True

# A stacked leaf's fresh buffers are populated chunk by chunk, each part just before its rows are
# written, instead of whole at the leaf's first chunk. Cold 1.1 GB Llama with the read-ahead ring:
# at its first chunk each builder populated its 8 device buffers of 29 MB (0.21 s), holding claimed
# ring runs meanwhile, so the ring stayed full and the disk idle from 0.2 to 0.4 s.
CHUNK_POPULATE = True

T = TypeVar("T")


class ByteBudget:
    """Caps the scratch bytes all builder threads hold at once; one oversized request may run alone.

    ``share`` (``limit / workers``) is the chunk size each thread aims for, so that every thread
    can build at the same time without waiting, and the scratch each keeps stays within its share.
    Requests are admitted in the order they come: a large one waiting for room is not overtaken by
    smaller ones, which would otherwise keep the budget busy until no other leaf is left (the tunix
    Qwen3 tree's 100 MB ``lm_head`` waited so until the end and then ran alone, issue 46).
    """

    def __init__(self, limit: int | None, workers: int = 1):
        self.limit = limit
        self.workers = max(1, workers)
        self.share = None if limit is None else max(1, limit // self.workers)
        self._held = 0
        self._next = 0  # the ticket the next request takes: the order requests came in
        self._serving = 0  # the ticket admitted next
        self._abandoned: set[int] = set()  # tickets whose requests stopped waiting
        self._cond = threading.Condition()

    def set_aside(self, nbytes: int) -> None:
        """``nbytes`` of scratch the load holds outside the builders (the read-ahead ring of
        :mod:`otfload.read.direct_ahead`): each thread's share, the scratch it keeps between chunks,
        shrinks by its part of them, so that the two together stay within the limit; admissions
        still count chunks against the whole limit."""
        if self.limit is not None:
            self.share = max(1, (self.limit - nbytes) // self.workers)

    def acquire(self, nbytes: int) -> None:
        limit = self.limit
        if limit is None:
            return
        with self._cond:
            ticket, self._next = self._next, self._next + 1
            try:
                self._cond.wait_for(
                    lambda: self._serving == ticket and (self._held == 0 or self._held + nbytes <= limit)
                )
            except BaseException:  # interrupted while waiting: its turn is skipped, no one waits on it
                self._abandoned.add(ticket)
                self._next_in_line()
                raise
            self._held += nbytes
            self._next_in_line(admitted=True)

    def _next_in_line(self, admitted: bool = False) -> None:
        """Move the turn past the request just admitted (and past abandoned ones); lock held."""
        self._serving += admitted
        while self._serving in self._abandoned:
            self._abandoned.remove(self._serving)
            self._serving += 1
        self._cond.notify_all()  # the next in line may fit too

    def release(self, nbytes: int) -> None:
        if self.limit is None:
            return
        with self._cond:
            self._held -= nbytes
            self._cond.notify_all()

    @property
    def held(self) -> int:
        """Bytes acquired and not yet released (0 once every build has ended, failed or not)."""
        with self._cond:
            return self._held


def _chunks(combos: list[tuple[int, ...]], per_combo: int, limit: int | None) -> list[list[tuple[int, ...]]]:
    """Consecutive runs of stack slices whose source bytes fit ``limit`` (at least one slice each)."""
    if limit is None or not combos:
        return [combos]
    size = max(1, limit // max(1, per_combo))
    return [combos[i : i + size] for i in range(0, len(combos), size)]


def _chunk_limit(budget: ByteBudget, reader: TensorReader) -> int | None:
    """The source bytes one chunk of stack slices may hold: the thread's share of the budget, and
    from mapped files at most :data:`MAPPED_CHUNK_BYTES`."""
    if not reader.maps:
        return budget.share
    return MAPPED_CHUNK_BYTES if budget.share is None else min(budget.share, MAPPED_CHUNK_BYTES)


def host_staged(sharding: jax.sharding.Sharding) -> bool:
    """Whether ``sharding``'s devices copy host buffers into memory of their own (accelerators),
    so that a host buffer is free again once the leaf is placed; CPU devices adopt it instead."""
    devices: set[jax.Device] = sharding.device_set
    return HOST_STAGING and all(device.platform != "cpu" for device in devices)


def build_boxes(
    plan: LeafPlan, boxes: list[Box], reader: TensorReader, arena: Arena, budget: ByteBudget | None = None
) -> dict[Box, np.ndarray]:
    """The values of ``plan``'s leaf inside each of ``boxes``, in fresh aligned target-dtype arrays."""
    return _build(plan, boxes, reader, arena, budget, _owned, None)


def _owned(built: dict[Box, np.ndarray]) -> dict[Box, np.ndarray]:
    """``built`` with each view of scratch or mapped pages (see :func:`_stack_into`) copied out."""
    return {box: a if a.flags.c_contiguous else _aligned_copy(a) for box, a in built.items()}


def _build(
    plan: LeafPlan, boxes: list[Box], reader: TensorReader, arena: Arena, budget: ByteBudget | None,
    finish: Callable[[dict[Box, np.ndarray]], T], staging: Arena | None, stack: Stacker | None = None,
) -> T:
    """:func:`build_boxes`, handing the boxes to ``finish`` before the last chunk's scratch and
    mapped pages are released: a box may be a transposed view of them, which ``finish`` copies.
    With ``staging`` (a device that copies what it is given), boxes are written there, or are
    contiguous views of what was read, instead of fresh buffers. ``stack(plan, box, need, union,
    combos, parts, results)`` writes a chunk's pieces into ``results`` (default: through the hooks
    into the leaf's box, :func:`_stack_into`; the device route stacks them raw)."""
    budget = budget or ByteBudget(None)
    n_stack = len(plan.stack_axes)
    strides = [int(np.prod(plan.stack_shape[d + 1 :], dtype=np.int64)) for d in range(n_stack)]
    need = {box: chain_needed(plan.hooks, plan.shapes, box[n_stack:]) for box in boxes}
    union, selection = source_region(plan, boxes)  # selection: widening hooks (kv_b heads, strided slices) leave holes
    shared = leaf_sibling_selection(plan, boxes)  # ... and sibling leaves read there (the pages they count)
    combos_of = {box: list(itertools.product(*(range(a, b) for a, b in box[:n_stack]))) for box in boxes}
    all_combos = sorted(set().union(*combos_of.values()))
    results: dict[Box, np.ndarray] = {}  # made at a box's first piece (see _stack_into)
    per_combo = box_nbytes(union, plan.sources[0].dtype.itemsize) if plan.sources else 0
    chunks = _chunks(all_combos, per_combo, _chunk_limit(budget, reader))
    for position, chunk in enumerate(chunks):
        held = per_combo * len(chunk)
        budget.acquire(held)
        indices: dict[tuple[int, ...], int] = {}
        try:
            if not reader.maps:  # the chunk is read into scratch: one buffer for all of it
                arena.reserve(held, len(chunk))
            indices = {c: sum(k * s for k, s in zip(c, strides, strict=True)) for c in chunk}
            # One call for the chunk: a remote source has every tensor's requests in flight together.
            read = reader.read_boxes([plan.sources[i] for i in indices.values()], union, arena, selection, shared)
            parts = dict(zip(indices, read, strict=True))
            for box in boxes:
                if stack is None:
                    _stack_into(plan, box, need[box], union, combos_of[box], parts, results, staging)
                else:
                    stack(plan, box, need[box], union, combos_of[box], parts, results)
            if position == len(chunks) - 1:  # the boxes are whole: placed while their pages are in
                whole = results if stack is not None else {b: _result(plan, b, results, staging) for b in boxes}
                finished = finish(whole)
                results = {}
        finally:
            parts = {}  # drop the pieces (views of scratch and mapped pages) before releasing them
            try:
                for i in indices.values():
                    reader.release(plan.sources[i], union)
            finally:  # whatever failed (any exception type), scratch and budget go back: no waiter hangs
                arena.reset()
                arena.trim(budget.share)
                budget.release(held)
    return finished


def _result(
    plan: LeafPlan, box: Box, results: dict[Box, np.ndarray], staging: Arena | None, populate: bool = True
) -> np.ndarray:
    """``box``'s buffer in ``results``, made (aligned, target dtype; fresh, or in ``staging``) if it
    has none yet; a fresh one unpopulated unless ``populate`` (see :func:`aligned_empty`)."""
    if box not in results:
        shape, dtype = box_shape(box), plan.leaf.dtype
        if plan.layout is not None:  # the buffer in the tree's layout, seen with the stack dims leading
            shape = tuple(shape[d] for d in plan.layout)
        if staging is None:
            buffer = aligned_empty(shape, dtype, populate)
        else:
            buffer = staging.take(box_nbytes(box, dtype.itemsize)).view(dtype).reshape(shape)
        results[box] = buffer if plan.layout is None else buffer.transpose(stacked_first_order(plan.layout))
    return results[box]


def stacked_first_order(layout: tuple[int, ...]) -> tuple[int, ...]:
    """The inverse of ``layout``: dim ``j`` of the stacked-first view is dim ``order[j]`` of the tree's."""
    return tuple(layout.index(j) for j in range(len(layout)))


def _stack_into(
    plan: LeafPlan, box: Box, need: Box, union: Box, combos: list[tuple[int, ...]],
    parts: dict[tuple[int, ...], np.ndarray], results: dict[Box, np.ndarray], staging: Arena | None,
) -> None:
    """Write the pieces of ``box`` present in ``parts`` into their rows of ``results[box]`` (one
    np.stack). An unstacked piece that the device copies as it is placed stays a view (one copy):
    a transposed one XLA's host transpose copies for CPU devices, a contiguous one an accelerator's."""
    inner = box[len(plan.stack_axes) :]
    rows = [i for i, c in enumerate(combos) if c in parts]  # consecutive: chunks follow row-major order
    if not rows:
        return
    pieces = []
    for i in rows:
        out, have = chain_apply(plan.hooks, plan.shapes, crop(parts[combos[i]], union, need), need)
        pieces.append(crop(out, have, inner))
    if not plan.stack_axes:
        piece = pieces[0]
        # Sent as read, unless staging is registered for direct DMA: a copy into it (which a
        # builder thread makes in parallel with the others) beats the runtime's staged copy.
        as_read = (
            staging is not None and not staging.registered and piece.dtype == plan.leaf.dtype
            and piece.flags.c_contiguous
        )
        if as_read or xla_copies(piece, plan.leaf.dtype, plan.leaf.sharding):
            results[box] = piece
        else:
            copy_into(_result(plan, box, results, staging), piece)
        return
    # Stacked row by row into a fresh buffer: each chunk's rows are populated just before they are
    # written, not the whole buffer at its first chunk (see CHUNK_POPULATE).
    by_rows = plan.layout is None and transposed_axis(pieces[0]) is None
    result = _result(plan, box, results, staging, populate=not (by_rows and CHUNK_POPULATE))
    if not result.flags.c_contiguous:  # stack dims inside the tree's layout: each slice into its place
        lead = box_shape(box[: len(plan.stack_axes)])
        for row, piece in zip(rows, pieces, strict=True):
            copy_into(result[np.unravel_index(row, lead)], piece)
        return
    flat = result.reshape((-1, *box_shape(inner)))
    if transposed_axis(pieces[0]) is not None:  # a transposing hook: tile by tile, not one strided copy
        for row, piece in zip(rows, pieces, strict=True):
            copy_into(flat[row], piece)
        return
    out = flat[rows[0] : rows[-1] + 1]
    if CHUNK_POPULATE and staging is None:
        populate_pages(out)
    np.stack(pieces, axis=0, out=out, casting="unsafe")


def build_leaf(
    plan: LeafPlan, reader: TensorReader, arena: Arena, budget: ByteBudget | None = None,
    staging: Arena | None = None, device_hooks: str = "auto",
) -> jax.Array:
    """The leaf as a ``jax.Array`` with its target sharding, built from the bytes local devices need;
    ``device_hooks``: where its hooks run (:func:`~otfload.place.device_hooks.hooks_on_device`).

    ``staging``: the thread's reusable host buffer for devices that copy what they are given
    (:func:`host_staged`); it is free again when this returns."""
    leaf = plan.placed
    target_boxes = dict(addressable_boxes(leaf.shape, leaf.sharding))  # in the sharding's order (place_shards wants it)
    # the boxes the plan builds: the same elements, the stack dims leading
    box_of = target_boxes if plan.layout is None else dict(addressable_boxes(plan.leaf.shape, plan.leaf.sharding))
    staging = staging if host_staged(leaf.sharding) else None

    def place(built: dict[Box, np.ndarray]) -> jax.Array:
        arrays, placed = [], set()
        for device in target_boxes:  # a box's first device adopts its buffer, the others get copies
            box = box_of[device]
            data = built[box] if plan.layout is None else built[box].transpose(plan.layout)
            # A view is copied by XLA for each device, and so is everything an accelerator is given.
            own = box in placed and data.flags.c_contiguous and staging is None
            arrays.append(_aligned_copy(data) if own else data)
            placed.add(box)
        array = place_shards(leaf.shape, leaf.dtype, leaf.sharding, arrays, list(target_boxes))
        return array.block_until_ready()  # the device has copied views and staging before they are reused

    boxes = list(dict.fromkeys(box_of.values()))
    try:
        if hooks_on_device(plan, device_hooks):  # raw boxes stacked as stored, laid out on the devices
            def on_devices(raw: dict[Box, np.ndarray]) -> jax.Array:
                return place_on_devices(plan, box_of, raw).block_until_ready()  # staging is free again

            return _build(plan, boxes, reader, arena, budget, on_devices, staging, raw_stacker(staging))
        return _build(plan, boxes, reader, arena, budget, place, staging)
    finally:
        if staging is not None:
            staging.reset()


def _aligned_copy(data: np.ndarray) -> np.ndarray:
    out = aligned_empty(data.shape, data.dtype)
    np.copyto(out, data)
    return out
