"""The load report: what a load fetched, placed and skipped, and how fast — and the byte counts
it is judged against, computed from the plan alone.

The per-leaf byte counts (device boxes, needed and ideal bytes) are the plan's
(:mod:`otfload.plan.leaf_bytes`); what a reader fetches for them is the reader's
(:meth:`~otfload.read.reader.TensorReader.planned`, by :mod:`otfload.fetch`'s rule). Three byte
counts per process, summed over a plan here and only here (the loader's report and ``otfload
inspect`` alike; :func:`process_counts` gives a plan's per leaf with the device memory each takes,
:func:`process_totals` and :func:`fetch_totals` sum them), from the most to the least fundamental:

* **ideal** (:func:`ideal_bytes`): the source bytes of the elements this process's devices hold,
  each distinct shard once — what no reader can go below;
* **planned** (:func:`planned_fetches`, :func:`planned_bytes`): what the reader will ask the source
  for, from the plan (the boxes it reads, the gaps it merges, whole pages of mapped files) —
  computed without reading;
* **read** (:attr:`LoadReport.bytes_read`): what the source really fetched, counted by the sources
  themselves (:class:`~otfload.fetch.meter.FetchMeter`): HTTP requests sent, gaps they merged
  included; ``preadv`` calls; page ranges a mapped file prefetched.
"""

from __future__ import annotations

import resource
from collections.abc import Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import jax
import numpy as np
import psutil
from jax.sharding import Sharding

from otfload.fetch.gaps import PAGE_BYTES
from otfload.plan.boxes import Box
from otfload.plan.leaf_bytes import leaf_reads, leaf_sibling_selection
from otfload.plan.planner import LeafPlan, LeafSignature, LoadPlan, leaf_signature
from otfload.read.reader import TensorReader


def current_rss() -> int:
    rss: int = psutil.Process().memory_info().rss
    return rss


def peak_rss() -> int:
    """The process's peak resident set size so far, in bytes.

    Linux's ``VmHWM`` (the peak of this process's own address space) where there is one:
    ``ru_maxrss`` also counts, after an ``exec``, the peak of the process that spawned it (the
    kernel carries it over from the old address space; Python's ``subprocess`` uses ``vfork``, so
    a child of a large test worker would report the worker's peak)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
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
    route: str = ""  # which route the load took and why (place/collective_route.route): agreed by every process
    reshard_seconds: float = 0.0
    # Activation-side scales of a quantized checkpoint (``input_scale``, ``k_scale``, ...): read for the
    # user's quantized kernels, never folded into weights.
    activation_scales: dict[str, np.ndarray] = field(default_factory=dict, repr=False)
    seconds: float = 0.0
    first_leaf_seconds: float = 0.0  # from the start of the reads to the first leaf on its devices
    # How shards went from host to device memory, and why (otfload.read.pinned.DmaRegistry.describe).
    host_route: str = ""
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
        if self.route and not self.route.startswith("one process"):
            unused += f"; route: {self.route}"
        return (
            f"loaded {self.leaves} leaves from {self.tensors_read} tensor reads in {len(self.files)} files: "
            f"{self.bytes_read / 1e9:.3f} GB in {self.seconds:.2f} s ({self.gbps:.2f} GB/s), "
            f"{self.requests} requests, planned {self.bytes_planned / 1e9:.3f} GB, "
            f"ideal {self.bytes_ideal / 1e9:.3f} GB, over-read {self.over_read:.2f}x, "
            f"peak RSS {self.peak_rss / 2**30:.2f} GiB{unused}"
        )


class FetchCount(NamedTuple):
    """Bytes a reader asks its source for, and in how many requests."""

    nbytes: int
    requests: int


class ProcessBytes(NamedTuple):
    """What one process's devices take of a leaf (or, summed by :func:`process_totals`, of a plan):
    ``needed``, the stored source bytes their boxes need, each HF tensor once
    (:meth:`~otfload.plan.planner.LeafPlan.process_bytes`); ``ideal``, the source bytes of the
    elements they hold, each distinct shard once; ``device``, the leaf's largest device shard in its
    target dtype (device memory)."""

    needed: int
    ideal: int
    device: int


Counts = TypeVar("Counts", FetchCount, ProcessBytes)


def _column_sums(counts: Iterable[Counts], zero: Counts) -> Counts:
    return type(zero)._make(sum(column) for column in zip(zero, *counts, strict=True))


def fetch_totals(counts: Iterable[FetchCount]) -> FetchCount:
    """The sum of ``counts``."""
    return _column_sums(counts, FetchCount(0, 0))


def process_totals(counts: Iterable[ProcessBytes]) -> ProcessBytes:
    """The sum of ``counts`` (a plan's, from :func:`process_counts`)."""
    return _column_sums(counts, ProcessBytes(0, 0, 0))


def process_counts(plan: LoadPlan, devices: Iterable[jax.Device] | None = None) -> dict[str, ProcessBytes]:
    """:class:`ProcessBytes` of each leaf of ``plan`` (by path) on ``devices`` (default: this
    process's); leaves that read alike (equal :func:`~otfload.plan.planner.leaf_signature`: the
    layers of an unscanned tree) are counted once."""
    devices = None if devices is None else list(devices)
    seen: dict[LeafSignature, ProcessBytes] = {}
    out = {}
    for path, p in plan.leaves.items():
        key = leaf_signature(p)
        if key not in seen:
            seen[key] = ProcessBytes(p.process_bytes(devices), p.ideal_bytes(devices), p.shard_bytes())
        out[path] = seen[key]
    return out


def leaf_planned(
    plan: LeafPlan, boxes: list[Box], reader: TensorReader,
    seen: dict[Hashable, dict[Hashable, FetchCount]] | None = None,
) -> FetchCount:
    """What ``reader`` asks its source for to build ``boxes`` of ``plan``'s leaf.
    ``seen`` (shared by the leaves of one plan) keeps the cost of each kind of read: the same leaf of
    every layer of an unscanned tree costs the same."""
    if not boxes or not plan.sources:
        return FetchCount(0, 0)
    union, selection, indices = leaf_reads(plan, boxes)
    seen = {} if seen is None else seen
    paged = reader.maps or reader.pages
    shared = leaf_sibling_selection(plan, boxes)  # siblings' pages are theirs; remotely, spans read them
    # Reads of one kind, shape, page offset (local files fetch whole pages) and region cost the
    # same: a leaf's stacked tensors, and the same leaf in every layer of an unscanned tree. The
    # region is hashed once per call, not once per stacked tensor (thousands of experts).
    same_region = seen.setdefault((union, selection, shared), {})
    needed = 0, 0
    for i in indices:
        info = plan.sources[i]
        page_offset = info.offset % PAGE_BYTES if paged and hasattr(info, "offset") else 0
        kind = (type(info), info.dtype, info.shape, page_offset)
        count = same_region.get(kind)
        if count is None:
            count = same_region[kind] = FetchCount(*reader.planned(info, union, selection, shared=shared))
        needed = needed[0] + count[0], needed[1] + count[1]
    return FetchCount(*needed)


def planned_fetches(
    plan: LoadPlan, reader: TensorReader, shardings: Mapping[str, Sharding | None] | None = None,
    devices: Iterable[jax.Device] | None = None,
) -> dict[str, FetchCount]:
    """What ``reader`` will fetch for each leaf of ``plan`` (by path) on ``devices`` (default: this
    process's), each leaf read under ``shardings[path]`` (default: its own sharding)."""
    shardings = shardings or {}
    devices = None if devices is None else list(devices)
    seen: dict[Hashable, dict[Hashable, FetchCount]] = {}
    return {path: leaf_planned(p, p.device_boxes(devices, shardings.get(path)), reader, seen)
            for path, p in plan.leaves.items()}


def planned_bytes(
    plan: LoadPlan, reader: TensorReader, shardings: Mapping[str, Sharding | None] | None = None,
    devices: Iterable[jax.Device] | None = None,
) -> int:
    """Bytes ``reader`` will fetch for every leaf of ``plan``: :func:`planned_fetches`, summed."""
    return fetch_totals(planned_fetches(plan, reader, shardings, devices).values()).nbytes


def ideal_bytes(plan: LoadPlan, devices: Iterable[jax.Device] | None = None) -> int:
    """:meth:`~otfload.plan.planner.LeafPlan.ideal_bytes` summed over the leaves of ``plan``."""
    devices = None if devices is None else list(devices)
    return sum(p.ideal_bytes(devices) for p in plan.leaves.values())
