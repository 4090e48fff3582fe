"""A plan's byte counts per process, from the plan alone: what one process's devices take of each
leaf (:class:`ProcessBytes`: needed, ideal, device) and of the plan, summed here and only here (the
loader's report and ``otfload inspect`` alike), and the record of what a reader will fetch
(:class:`FetchCount`, which :mod:`otfload.read.planned` fills).

From the most to the least fundamental:

* **ideal** (:func:`ideal_bytes`): the source bytes of the elements this process's devices hold,
  each distinct shard once — what no reader can go below;
* **needed** (:func:`process_counts`): the stored source bytes their boxes need, each HF tensor once;
* **planned** (:func:`otfload.read.planned.planned_bytes`): what the reader will ask the source for;
* **read** (:attr:`otfload.place.report.LoadReport.bytes_read`): what the source really fetched.

The per-leaf counts themselves are :mod:`otfload.plan.leaf_bytes`'.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple, TypeVar

import jax

from otfload.plan.planner import LeafSignature, LoadPlan, leaf_signature


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


def ideal_bytes(plan: LoadPlan, devices: Iterable[jax.Device] | None = None) -> int:
    """:meth:`~otfload.plan.planner.LeafPlan.ideal_bytes` summed over the leaves of ``plan``."""
    devices = None if devices is None else list(devices)
    return sum(p.ideal_bytes(devices) for p in plan.leaves.values())
