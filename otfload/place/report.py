"""The load report: what a load fetched, placed and skipped, and how fast.

Its byte counts are judged against the plan's, computed from the plan alone: the ideal and needed
bytes of this process (:mod:`otfload.plan.process_bytes`) and what the reader will fetch
(``bytes_planned``: :mod:`otfload.read.planned`). What the source really fetched
(:attr:`LoadReport.bytes_read`) is counted by the sources themselves
(:class:`~otfload.accounting.meter.FetchMeter`): HTTP requests sent, gaps they merged included;
``preadv`` calls; page ranges a mapped file prefetched.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

import numpy as np
import psutil


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
