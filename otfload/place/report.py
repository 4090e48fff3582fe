"""The load report: what a load fetched, placed and skipped, and how fast — and the byte counts
it is judged against, computed from the plan alone.

Three byte counts per process, from the most to the least fundamental:

* **ideal** (:func:`ideal_bytes`): the source bytes of the elements this process's devices hold,
  each distinct shard once — what no reader can go below;
* **planned** (:func:`planned_bytes`): what the reader will ask the source for, from the plan (the
  boxes it reads, the gaps it merges, whole pages of mapped files) — computed without reading;
* **read** (:attr:`LoadReport.bytes_read`): what the source really fetched, counted by the sources
  themselves (:class:`~otfload.sources.ranges.FetchMeter`): HTTP requests sent, gaps they merged
  included; ``preadv`` calls; page ranges a mapped file prefetched.
"""

from __future__ import annotations

import math
import mmap
import resource
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import psutil

from otfload.plan.boxes import Box, box_from_index, box_size, selection_union
from otfload.plan.hooks import chain_needed, chain_selection


def current_rss() -> int:
    return psutil.Process().memory_info().rss


def peak_rss() -> int:
    """The process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


@dataclass
class LoadReport:
    """Counters of one load; ``summary()`` is the one-line version."""

    source: str = ""
    leaves: int = 0
    tensors_read: int = 0
    bytes_read: int = 0  # fetched from the source (requests, preadv, prefetched pages), gaps included
    bytes_needed: int = 0  # the bytes of the boxes read (their holes excluded), without gaps
    bytes_planned: int = 0  # what the plan says this process fetches (see planned_bytes)
    bytes_ideal: int = 0  # source bytes of the elements this process's devices hold (see ideal_bytes)
    bytes_placed: int = 0
    requests: int = 0  # requests the source really sent (HTTP ranges, preadv calls, prefetch calls)
    files: list[str] = field(default_factory=list)
    unused_tensors: list[str] = field(default_factory=list)
    resharded: list[str] = field(default_factory=list)  # leaves read as bands, then moved by a collective
    reshard_seconds: float = 0.0
    # Activation-side scales of a quantized checkpoint (``input_scale``, ``k_scale``, ...): read for the
    # user's quantized kernels, never folded into weights.
    activation_scales: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    seconds: float = 0.0
    rss_before: int = 0
    peak_rss: int = 0

    @property
    def gbps(self) -> float:
        return self.bytes_read / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def over_read(self) -> float:
        """Bytes fetched per ideal byte (> 1 when gaps, pages or whole boxes were read beyond the
        elements this process holds)."""
        return self.bytes_read / self.bytes_ideal if self.bytes_ideal else 1.0

    def summary(self) -> str:
        unused = f", {len(self.unused_tensors)} unused tensors skipped" if self.unused_tensors else ""
        if self.resharded:
            unused += f", {len(self.resharded)} leaves resharded in {self.reshard_seconds:.2f} s"
        return (
            f"loaded {self.leaves} leaves from {self.tensors_read} tensor reads in {len(self.files)} files: "
            f"{self.bytes_read / 1e9:.3f} GB in {self.seconds:.2f} s ({self.gbps:.2f} GB/s), "
            f"{self.requests} requests, planned {self.bytes_planned / 1e9:.3f} GB, "
            f"ideal {self.bytes_ideal / 1e9:.3f} GB, over-read {self.over_read:.2f}x, "
            f"peak RSS {self.peak_rss / 2**30:.2f} GiB{unused}"
        )


def process_boxes(leaf, sharding=None, devices: Iterable | None = None) -> list[Box]:
    """The distinct boxes of ``leaf`` on ``devices`` (default: this process's) under ``sharding``
    (default: the leaf's own), in device order."""
    sharding = leaf.sharding if sharding is None else sharding
    if devices is None:
        index_map = sharding.addressable_devices_indices_map(leaf.shape)
    else:
        wanted = set(devices)
        index_map = {d: i for d, i in sharding.devices_indices_map(leaf.shape).items() if d in wanted}
    return list(dict.fromkeys(box_from_index(index, leaf.shape) for index in index_map.values()))


def leaf_reads(plan, boxes: list[Box]) -> tuple[Box, tuple, list[int]]:
    """What the builder reads for ``boxes`` of ``plan``'s leaf: the union box of each source tensor,
    the selection inside it, and the indices of the stacked source tensors read (row-major)."""
    from otfload.place.builder import bounding_box

    n = len(plan.stack_axes)
    inner = list(dict.fromkeys(box[n:] for box in boxes))
    union = bounding_box([chain_needed(plan.hooks, plan.shapes, box) for box in inner])
    selection = selection_union([chain_selection(plan.hooks, plan.shapes, box) for box in inner])
    if not n:
        return union, selection, [0]
    flat = [np.ravel_multi_index(np.ix_(*(np.arange(a, b) for a, b in stack)), plan.stack_shape).ravel()
            for stack in dict.fromkeys(box[:n] for box in boxes)]
    return union, selection, np.unique(np.concatenate(flat)).tolist()


def leaf_planned(plan, boxes: list[Box], reader) -> tuple[int, int]:
    """``(bytes, requests)`` ``reader`` asks its source for to build ``boxes`` of ``plan``'s leaf."""
    if not boxes or not plan.sources:
        return 0, 0
    union, selection, indices = leaf_reads(plan, boxes)
    total_bytes = total_requests = 0
    seen: dict = {}
    paged = reader.maps or reader.pages
    for i in indices:
        info = plan.sources[i]
        # Stacked tensors share shape (and, but for mixed checkpoints, dtype and kind): for local
        # files only where a page boundary falls in the tensor can differ.
        key = (type(info), info.dtype, info.offset % mmap.PAGESIZE if paged and hasattr(info, "offset") else 0)
        if key not in seen:
            seen[key] = reader.planned(info, union, selection)
        total_bytes += seen[key][0]
        total_requests += seen[key][1]
    return total_bytes, total_requests


def leaf_needed(plan, boxes: list[Box]) -> int:
    """Stored bytes of the source elements ``boxes`` of ``plan``'s leaf need (each HF tensor once),
    without pages or gaps."""
    from otfload.read.reader import needed_bytes

    if not boxes or not plan.sources:
        return 0
    union, selection, indices = leaf_reads(plan, boxes)
    return sum(needed_bytes(plan.sources[i], union, selection) for i in indices)


def planned_bytes(plan, reader, shardings: dict | None = None, devices: Iterable | None = None) -> int:
    """Bytes ``reader`` will fetch for every leaf of ``plan`` on ``devices`` (default: this
    process's), each leaf read under ``shardings[path]`` (default: its own sharding)."""
    shardings = shardings or {}
    devices = None if devices is None else list(devices)
    return sum(
        leaf_planned(p, process_boxes(p.leaf, shardings.get(path), devices), reader)[0]
        for path, p in plan.leaves.items()
    )


def leaf_ideal(plan, devices: Iterable | None = None) -> int:
    """Source bytes of the elements of ``plan``'s leaf that ``devices`` hold, each distinct shard once."""
    if not plan.sources:
        return 0
    held = sum(box_size(box) for box in process_boxes(plan.leaf, None, devices))
    source_elements = len(plan.sources) * math.prod(plan.shapes[0])
    return plan.source_bytes * held // max(1, source_elements) if source_elements else 0


def ideal_bytes(plan, devices: Iterable | None = None) -> int:
    """:func:`leaf_ideal` summed over the leaves of ``plan``."""
    devices = None if devices is None else list(devices)
    return sum(leaf_ideal(p, devices) for p in plan.leaves.values())
