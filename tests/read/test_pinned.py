"""The DMA registry: what it registers, and how a refusal becomes the load's stated route."""

import jax
import numpy as np
import pytest

from otfload.read.arena import Arena
from otfload.read.pinned import HOST_RING_ENV, MIN_REGISTERED_BYTES, DmaRegistry, host_ring_bytes


class RecordingRegistry(DmaRegistry):
    """A registry whose client is a ledger of registered addresses: the accelerator's ``dma_map``
    does not exist on CPU devices, and the arena's bookkeeping is what is under test."""

    def __init__(self) -> None:
        super().__init__([])
        self.reason = None
        self.live: dict[int, int] = {}
        self.events: list[tuple[str, int]] = []

    def register(self, buffer: np.ndarray) -> bool:
        if buffer.nbytes < MIN_REGISTERED_BYTES:
            return False
        self.live[buffer.ctypes.data] = buffer.nbytes
        self.events.append(("map", buffer.ctypes.data))
        return True

    def unregister(self, buffer: np.ndarray) -> None:
        if self.live.pop(buffer.ctypes.data, None) is not None:
            self.events.append(("unmap", buffer.ctypes.data))


def test_cpu_devices_register_nothing_and_say_why():
    registry = DmaRegistry(jax.devices())
    assert not registry.available and "CPU" in (registry.reason or "")
    assert not registry.register(np.zeros(2 * MIN_REGISTERED_BYTES, np.uint8))
    assert registry.registered == 0
    assert registry.describe().startswith("CPU devices")


def test_a_client_that_refuses_makes_the_route_the_staged_copy():
    """The CPU client's real ``dma_map`` answers UNIMPLEMENTED: the first refusal is kept as the reason
    and nothing is tried after it."""
    registry = DmaRegistry([])
    registry._client, registry.reason, registry.platform = jax.devices()[0].client, None, "test"
    buffer = np.zeros(2 * MIN_REGISTERED_BYTES, np.uint8)
    assert not registry.register(buffer)
    assert not registry.available
    assert "dma_map refused" in (registry.reason or "") and "UNIMPLEMENTED" in (registry.reason or "")
    assert registry.describe().startswith("runtime's staged copy (dma_map refused")
    registry.close()  # nothing registered: nothing to undo


def test_ring_size_from_argument_or_default(monkeypatch):
    monkeypatch.setenv(HOST_RING_ENV, str(64 << 20))  # read by the load's options, not here
    assert host_ring_bytes() == 1 << 30
    assert host_ring_bytes(5) == 5
    registry = DmaRegistry([], 0)
    assert host_ring_bytes(0) == 0 and registry.ring_bytes == 0


def test_arena_registers_its_buffers_and_unregisters_outgrown_ones_only_at_reset():
    """A buffer the arena outgrows may still be read by a transfer in flight: it stays registered (and
    alive) until reset; close unregisters the rest."""
    registry = RecordingRegistry()
    arena = Arena(registry)
    arena.reserve(2 * MIN_REGISTERED_BYTES)
    first = arena.take(MIN_REGISTERED_BYTES)
    assert arena.registered and len(registry.live) == 1
    first[:] = 7
    arena.take(4 * MIN_REGISTERED_BYTES)  # outgrows: a new registered buffer, the old one kept
    assert len(registry.live) == 2
    assert (first == 7).all()  # still alive and untouched
    arena.reset()
    assert len(registry.live) == 1  # the outgrown buffer is unregistered now
    arena.trim(MIN_REGISTERED_BYTES)  # larger than the limit: freed and unregistered
    assert registry.live == {} and not arena.registered and arena.capacity == 0
    arena.take(2 * MIN_REGISTERED_BYTES)
    arena.close()
    assert registry.live == {} and arena.capacity == 0
    maps = [a for e, a in registry.events if e == "map"]
    unmaps = [a for e, a in registry.events if e == "unmap"]
    assert sorted(maps) == sorted(unmaps)  # every registration undone exactly once


@pytest.mark.parametrize("nbytes", [MIN_REGISTERED_BYTES // 2])
def test_small_buffers_are_not_registered(nbytes):
    registry = RecordingRegistry()
    arena = Arena(registry)
    arena.take(nbytes)
    assert not arena.registered and registry.live == {}
