"""Host memory an accelerator copies from directly: buffers registered with its client for DMA.

``jax.device_put`` of ordinary (pageable) host memory onto a GPU goes through a pinned staging pool
that the runtime grows on first use and keeps: measured on an H200 (docs/benchmarks.md, "Into GPU
memory"), one copy at a time moves 6-9 GB/s once the pool has grown (1.1 GB/s while it grows),
64 MiB pieces all in flight ~30 GB/s, and the pool stays resident after the load (~1.6x the bytes
copied). A host buffer registered with the client (``client.dma_map(address, size)``: its pages
locked and mapped for the device's copy engines) is copied from in place: 54 GB/s, the PCIe gen 5
link, with no staging copy and no pool.

Registering costs time in proportion to the buffer (every page is locked and mapped) and locked
memory is a limited resource, so the builders register their staging buffers once per load and
reuse them from leaf to leaf (:class:`~otfload.read.arena.Arena` with a registry); together they
make the *host ring* of at most :data:`DEFAULT_HOST_RING_BYTES`. Where registration is refused —
CPU devices (which adopt host buffers without any copy, so there is nothing to gain), a platform
whose client has no DMA mapping, a locked-memory limit — the first refusal is kept as the reason,
nothing is registered after it, and the load takes the runtime's staged copy (the report says
which route a load took and why).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import jax
import numpy as np

# The host ring: staging bytes all builders of one load keep registered together, split evenly among
# them (a shard larger than a builder's share grows its buffer for that leaf, registered too, and the
# buffer shrinks back after it). 1 GiB holds a few 64 MiB device pieces per builder in flight on a
# 16-core host, and is small beside the host memory of any machine with an accelerator.
DEFAULT_HOST_RING_BYTES = 1 << 30
# Environment variable that sets the ring's size in bytes (0: register nothing, take the staged copy).
HOST_RING_ENV = "OTFLOAD_HOST_RING_BYTES"
# Buffers smaller than this are not registered: locking and mapping a buffer costs a system call and
# page-table work per call, while the runtime stages a small copy in microseconds. Staging buffers
# start at the builder's share of the ring, so in practice every large shard goes from registered memory.
MIN_REGISTERED_BYTES = 1 << 20


def host_ring_bytes(given: int | None = None) -> int:
    """The ring's size: ``given`` (the load's ``host_ring_bytes``, which ``$OTFLOAD_HOST_RING_BYTES``
    sets), else the default."""
    return DEFAULT_HOST_RING_BYTES if given is None else max(0, int(given))


class DmaRegistry:
    """Registers host buffers with the client of ``devices`` for direct DMA, for one load.

    Thread-safe; :meth:`close` unregisters whatever is still registered. ``reason`` says why nothing
    is (``None`` while registration works)."""

    def __init__(self, devices: Iterable[jax.Device], ring_bytes: int | None = None):
        accelerators = [d for d in devices if d.platform != "cpu"]
        self._client = accelerators[0].client if accelerators else None
        self.platform = accelerators[0].platform if accelerators else "cpu"
        self.ring_bytes = host_ring_bytes(ring_bytes)
        self.reason: str | None = None
        if not accelerators:
            self.reason = "CPU devices adopt host buffers: no copy to speed up"
        elif self.ring_bytes == 0:
            self.reason = f"host ring size 0 (${HOST_RING_ENV})"
        self._mapped: dict[int, int] = {}  # address -> size
        self._lock = threading.Lock()
        self.registered_peak = 0

    @property
    def available(self) -> bool:
        """Whether buffers are being registered (no refusal so far)."""
        return self.reason is None

    def register(self, buffer: np.ndarray) -> bool:
        """Register ``buffer``'s memory (kept alive by the caller until :meth:`unregister`); whether it
        now is. The first refusal makes the registry unavailable, with its reason."""
        if not self.available or buffer.nbytes < MIN_REGISTERED_BYTES or self._client is None:
            return False
        address, size = buffer.ctypes.data, buffer.nbytes
        try:
            self._client.dma_map(address, size)
        except Exception as e:  # noqa: BLE001 (any refusal: platform, permissions, locked-memory limit)
            with self._lock:
                self.reason = self.reason or f"dma_map refused on {self.platform}: {type(e).__name__}: {e}"
            return False
        with self._lock:
            self._mapped[address] = size
            self.registered_peak = max(self.registered_peak, sum(self._mapped.values()))
        return True

    def unregister(self, buffer: np.ndarray) -> None:
        """Undo :meth:`register` (nothing if ``buffer`` was not registered). Call only once every
        transfer from it has completed."""
        with self._lock:
            size = self._mapped.pop(buffer.ctypes.data, None)
        if size is not None and self._client is not None:
            self._client.dma_unmap(buffer.ctypes.data)

    @property
    def registered(self) -> int:
        """Bytes registered now."""
        with self._lock:
            return sum(self._mapped.values())

    def describe(self) -> str:
        """The host-to-device route of the load, for its report."""
        if self.available:
            return f"direct DMA from a registered host ring ({self.registered_peak / 2**30:.2f} GiB at most)"
        if self.platform == "cpu":
            return "CPU devices: host buffers adopted, no copy"
        return f"runtime's staged copy ({self.reason})"

    def close(self) -> None:
        """Unregister everything still registered (the buffers must still be alive)."""
        with self._lock:
            addresses, self._mapped = list(self._mapped), {}
        if self._client is not None:
            for address in addresses:
                self._client.dma_unmap(address)
