"""The load report: what a load read, placed and skipped, and how fast."""

from __future__ import annotations

import resource
from dataclasses import dataclass, field

import numpy as np
import psutil


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
    bytes_read: int = 0
    bytes_needed: int = 0
    bytes_planned: int = 0
    bytes_placed: int = 0
    requests: int = 0
    files: list[str] = field(default_factory=list)
    unused_tensors: list[str] = field(default_factory=list)
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
        """Bytes read per byte the local shards need (> 1 when gaps were read to save requests)."""
        return self.bytes_read / self.bytes_needed if self.bytes_needed else 1.0

    def summary(self) -> str:
        unused = f", {len(self.unused_tensors)} unused tensors skipped" if self.unused_tensors else ""
        return (
            f"loaded {self.leaves} leaves from {self.tensors_read} tensor reads in {len(self.files)} files: "
            f"{self.bytes_read / 1e9:.3f} GB in {self.seconds:.2f} s ({self.gbps:.2f} GB/s), "
            f"{self.requests} requests, over-read {self.over_read:.2f}x, "
            f"peak RSS {self.peak_rss / 2**30:.2f} GiB{unused}"
        )
