"""The first host-to-device transfer of a process, started early so that no leaf waits for it.

On an H200 the first ``jax.device_put`` of a process took ~1.5-2 s whatever its size (a 1 MiB one
first, then 4 GiB moved at 6.1 GB/s instead of 1.0; ``XLA_PJRT_GPU_HOST_MEMORY_PREALLOCATE`` did
not change it): one-time set-up inside the runtime on first use (its transfer streams and host
staging allocator, the driver's lazily loaded modules). Its cause cannot be removed from a library,
so a load starts it at its very top — before headers are fetched, the model is traced and the plan
is made — in a background thread, one tiny transfer per local accelerator; by the time the first
shard is placed it has finished, or the placement waits only for what is left of it.

``benchmarks/gpu_run.sh`` measures the first transfer of a fresh process and the load with and
without a transfer before it. CPU devices have no such cost: nothing is started for them.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import jax
import numpy as np


def start_first_transfers(devices: Iterable[jax.Device]) -> threading.Thread | None:
    """Start one tiny host-to-device copy to each accelerator among ``devices`` in a daemon thread
    (returned, ``None`` when there is none to warm). A failure there is left for the load to meet
    and report: the warm-up only moves a one-time cost earlier."""
    accelerators = [d for d in devices if d.platform != "cpu"]
    if not accelerators:
        return None
    thread = threading.Thread(target=_transfer_once, args=(accelerators,), name="otfload-first-transfer", daemon=True)
    thread.start()
    return thread


def _transfer_once(devices: list[jax.Device]) -> None:
    try:
        for array in [jax.device_put(np.zeros(1, np.uint8), d) for d in devices]:
            array.block_until_ready()
    except Exception:  # noqa: BLE001, S110 (the load meets the same device and reports it)
        pass
