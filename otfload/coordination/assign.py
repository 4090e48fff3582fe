"""Which process fetches which file: a deterministic, size-balanced split of the checkpoint files."""

from __future__ import annotations

import heapq
from collections.abc import Mapping


def assign_files(sizes: Mapping[str, int], process_count: int) -> dict[str, int]:
    """Map every file to the process that fetches it, balancing the bytes each process fetches.

    Largest files first, each to the process with the fewest bytes so far (ties: lowest index).
    Every process computes the same answer from the same ``sizes``, without communicating.
    """
    if process_count < 1:
        raise ValueError(f"process_count must be >= 1, got {process_count}")
    loads = [(0, p) for p in range(process_count)]
    owners: dict[str, int] = {}
    for name in sorted(sizes, key=lambda n: (-sizes[n], n)):
        load, process = heapq.heappop(loads)
        owners[name] = process
        heapq.heappush(loads, (load + sizes[name], process))
    return owners
