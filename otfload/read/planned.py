"""What a reader will fetch for a plan, computed without reading: per leaf the bytes and requests
:meth:`~otfload.read.reader.TensorReader.planned` says it asks its source for (by
:mod:`otfload.accounting`'s rule: the boxes it reads, the gaps it merges, whole pages of mapped files),
for the loader's report (``bytes_planned``), ``otfload inspect`` and the read-layout chooser.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Mapping

import jax
from jax.sharding import Sharding

from otfload.accounting.gaps import PAGE_BYTES
from otfload.plan.boxes import Box
from otfload.plan.leaf_bytes import leaf_reads, leaf_sibling_selection
from otfload.plan.planner import LeafPlan, LoadPlan
from otfload.plan.process_bytes import FetchCount, fetch_totals
from otfload.read.reader import TensorReader


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
