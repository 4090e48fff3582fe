import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from otfload.index.checkpoint import open_index
from otfload.place.builder import ByteBudget, build_leaf, host_staged
from otfload.plan.abstract import abstract_from_pytree
from otfload.plan.hooks import Reshape, Transpose
from otfload.plan.mapping import MappingTable, Rule
from otfload.plan.planner import build_plan
from otfload.read.arena import Arena
from otfload.read.reader import TensorReader
from otfload.sources import LocalSource
from tests.synthetic import write_checkpoint

TABLE = MappingTable((Rule("layers.{layer}.o", "l.{layer}.o", (Transpose(), Reshape((4, 8, 16)))),))


@pytest.fixture
def setup(tmp_path, closing):
    rng = np.random.default_rng(0)
    tensors = {f"l.{i}.o": rng.standard_normal((16, 32), dtype=np.float32) for i in range(6)}
    index = open_index(closing(LocalSource(write_checkpoint(tmp_path / "c", tensors))), require_config=False)
    want = np.stack([tensors[f"l.{i}.o"].T.reshape(4, 8, 16) for i in range(6)])
    return index, want


@pytest.mark.parametrize("spec", [P(None, "tp", None, "fsdp"), P("fsdp", "tp"), P(), P(None, None, "tp")])
@pytest.mark.parametrize("budget", [None, 1])
def test_leaf_shards_hold_numpy_reference(setup, mesh_2x4, spec, budget):
    index, want = setup
    sharding = NamedSharding(mesh_2x4, spec)
    leaves, _ = abstract_from_pytree({"layers": {"o": jax.ShapeDtypeStruct(want.shape, np.float32, sharding=sharding)}})
    plan = build_plan(index, leaves, TABLE).leaves["layers.o"]
    reader = TensorReader(index.source)
    array = build_leaf(plan, reader, Arena(), ByteBudget(budget))
    assert array.sharding == sharding
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    # each HF tensor is read once per process, whatever the sharding
    assert reader.stats.pieces == 6


def test_budget_blocks_over_limit_and_admits_an_oversized_request_alone():
    import threading

    budget = ByteBudget(10, workers=2)
    assert budget.share == 5
    budget.acquire(100)  # larger than the limit, but nothing else is held: admitted
    budget.release(100)
    budget.acquire(8)
    admitted = threading.Event()
    waiter = threading.Thread(target=lambda: (budget.acquire(5), admitted.set()))
    waiter.start()
    assert not admitted.wait(0.2)  # 8 + 5 > 10: must wait
    budget.release(8)
    assert admitted.wait(5)
    waiter.join()
    budget.release(5)


def test_budget_admits_requests_in_order_so_a_large_one_is_not_starved():
    import threading
    import time

    budget = ByteBudget(10, workers=2)
    budget.acquire(6)
    order: list[int] = []

    def request(nbytes: int) -> threading.Thread:
        thread = threading.Thread(target=lambda: (budget.acquire(nbytes), order.append(nbytes)))
        tickets = budget._next
        thread.start()
        deadline = time.monotonic() + 5
        while budget._next == tickets and time.monotonic() < deadline:  # until it has taken its ticket
            time.sleep(0.005)
        return thread

    large = request(10)  # must wait for the 6 to go
    small = request(2)  # 6 + 2 fits, but it came after the large one
    small.join(0.2)
    assert order == []
    budget.release(6)
    large.join(5)
    assert order == [10]
    budget.release(10)
    small.join(5)
    assert order == [10, 2]
    budget.release(2)
    assert budget.held == 0


def test_arena_trims_after_an_oversized_tensor():
    arena = Arena()
    arena.take(1000)
    arena.reset()
    arena.trim(2000)
    assert arena.capacity >= 1000  # within its share: kept for reuse
    arena.trim(500)
    assert arena.capacity == 0  # beyond its share: freed


class _CleanupFails(LocalSource):
    """A source whose cleanup itself fails with a non-OSError, as a mapping's madvise once could."""

    def release(self, file: str, offset: int, length: int) -> None:
        raise ValueError("madvise length invalid")


@pytest.mark.parametrize("fault", ["truncated", "cleanup"])
def test_a_failed_build_gives_back_its_budget_and_scratch(tmp_path, mesh_2x4, fault, closing):
    import os
    import threading

    from otfload.errors import TruncatedFileError

    rng = np.random.default_rng(0)
    tensors = {f"l.{i}.o": rng.standard_normal((16, 32), dtype=np.float32) for i in range(6)}
    root = write_checkpoint(tmp_path / "c", tensors, files=1)
    source = closing(LocalSource(root, mmap=False) if fault == "truncated" else _CleanupFails(root))
    index = open_index(source, require_config=False)
    leaf = jax.ShapeDtypeStruct((6, 4, 8, 16), np.float32, sharding=NamedSharding(mesh_2x4, P()))
    leaves, _ = abstract_from_pytree({"layers": {"o": leaf}})
    plan = build_plan(index, leaves, TABLE).leaves["layers.o"]
    if fault == "truncated":
        os.truncate(root / "model-00001-of-00001.safetensors", 1000)
    budget, arena = ByteBudget(plan.source_bytes, workers=2), Arena()
    with pytest.raises(TruncatedFileError if fault == "truncated" else ValueError):
        build_leaf(plan, TensorReader(source), arena, budget)
    assert budget.held == 0
    arena.trim(0)
    assert arena.capacity == 0  # reset: nothing handed out is still counted as in use
    # a builder waiting for the whole budget is admitted at once
    admitted = threading.Event()
    threading.Thread(target=lambda: (budget.acquire(plan.source_bytes), admitted.set()), daemon=True).start()
    assert admitted.wait(5)


class _Peak(ByteBudget):
    """A budget that remembers the most bytes one chunk acquired."""

    largest = 0

    def acquire(self, nbytes: int) -> None:
        self.largest = max(self.largest, nbytes)
        super().acquire(nbytes)


@pytest.mark.parametrize("mapped", [True, False])
def test_mapped_chunks_stay_within_the_cap_whatever_the_budget(tmp_path, mesh_2x4, monkeypatch, mapped, closing):
    from otfload.place import builder

    monkeypatch.setattr(builder, "MAPPED_CHUNK_BYTES", 2 * 16 * 32 * 4)  # two layers' bytes
    rng = np.random.default_rng(1)
    tensors = {f"l.{i}.o": rng.standard_normal((16, 32), dtype=np.float32) for i in range(6)}
    source = closing(LocalSource(write_checkpoint(tmp_path / "c", tensors), mmap=mapped))
    index = open_index(source, require_config=False)
    want = np.stack([tensors[f"l.{i}.o"].T.reshape(4, 8, 16) for i in range(6)])
    leaf = jax.ShapeDtypeStruct(want.shape, np.float32, sharding=NamedSharding(mesh_2x4, P(None, "tp")))
    leaves, _ = abstract_from_pytree({"layers": {"o": leaf}})
    plan = build_plan(index, leaves, TABLE).leaves["layers.o"]
    budget = _Peak(10 * plan.source_bytes)  # room for the whole leaf at once
    array = build_leaf(plan, TensorReader(source), Arena(), budget)
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    # mapped pages stay in RSS until their chunk is stacked: at most the cap; plain reads use the share
    assert budget.largest == (2 * 16 * 32 * 4 if mapped else plan.source_bytes)


@pytest.mark.parametrize("mapped", [True, False])
@pytest.mark.parametrize("spec", [P(None, "tp"), P("fsdp", "tp"), P()])
def test_an_unstacked_transposed_leaf_is_placed_from_views_each_device_its_own_copy(
    tmp_path, mesh_2x4, closing, mapped, spec
):
    rng = np.random.default_rng(2)
    weight = rng.standard_normal((256, 512), dtype=np.float32)  # large enough for XLA's transpose
    source = closing(LocalSource(write_checkpoint(tmp_path / "c", {"w": weight}), mmap=mapped))
    index = open_index(source, require_config=False)
    sharding = NamedSharding(mesh_2x4, spec)
    leaves, _ = abstract_from_pytree({"w": jax.ShapeDtypeStruct((512, 256), np.float32, sharding=sharding)})
    plan = build_plan(index, leaves, MappingTable((Rule("w", "w", (Transpose(),)),))).leaves["w"]
    array = build_leaf(plan, TensorReader(source), Arena(), ByteBudget(None))
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), weight.T[shard.index])
    pointers = [shard.data.unsafe_buffer_pointer() for shard in array.addressable_shards]
    assert len(set(pointers)) == len(pointers)  # replicas never alias one buffer (donation writes them)


def test_cpu_devices_adopt_their_buffers_so_nothing_is_staged(mesh_2x4):
    """Staging is reused from leaf to leaf only where devices copy what they get (accelerators): CPU
    devices keep the buffer they are given (test_put: adopted without a copy)."""
    assert not host_staged(NamedSharding(mesh_2x4, P("fsdp", "tp")))


@pytest.mark.parametrize("registered", [False, True])
def test_registered_staging_receives_every_unstacked_shard(tmp_path, closing, mesh_2x4, monkeypatch, registered):
    """Where staging is registered for direct DMA, a contiguous unstacked shard is copied into it (the
    device then copies at the link's rate) instead of going as read (a view of the mapped file, which
    the runtime stages). CPU devices adopt what they are given, so the placed buffers show where the
    builder put each shard."""
    from otfload.place import builder
    from tests.read.test_pinned import RecordingRegistry

    weight = np.random.default_rng(1).standard_normal((1024, 512), dtype=np.float32)  # 2 MiB
    index = open_index(closing(LocalSource(write_checkpoint(tmp_path / "c", {"w": weight}))), require_config=False)
    sharding = NamedSharding(mesh_2x4, P("fsdp"))
    leaves, _ = abstract_from_pytree({"w": jax.ShapeDtypeStruct(weight.shape, np.float32, sharding=sharding)})
    plan = build_plan(index, leaves, MappingTable((Rule("w", "w"),))).leaves["w"]
    monkeypatch.setattr(builder, "host_staged", lambda sharding: True)  # as on an accelerator
    staging = Arena(RecordingRegistry() if registered else None)
    staging.reserve(4 << 20)
    start = staging.take(0).ctypes.data
    staging.reset()
    array = build_leaf(plan, TensorReader(index.source), Arena(), ByteBudget(None), staging)
    for shard in array.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), weight[shard.index])
    inside = [start <= s.data.unsafe_buffer_pointer() < start + staging.capacity for s in array.addressable_shards]
    assert all(inside) if registered else not any(inside)
