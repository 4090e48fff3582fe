"""The plan's byte counts (otfload.plan.leaf_bytes, LeafPlan's byte methods) against independent counts:
numpy arrays of element numbers pushed through the hooks, and per-device shapes from JAX's own
sharding of a real array."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import otfload
from otfload.plan.abstract import AbstractLeaf
from otfload.plan.boxes import box_from_index, box_to_slices
from otfload.plan.hooks import run_forward
from otfload.plan.leaf_bytes import bounding_box, device_bytes, held_bytes, placed_per_device


@pytest.fixture(scope="module")
def llama_plan(tiny_checkpoints, mesh_2x4):
    _, plan, src = otfload.plan_model(tiny_checkpoints("llama")[0], mesh=mesh_2x4, scan_layers=True)
    src.close()
    return plan


def test_process_bytes_of_one_device_are_the_source_elements_its_shard_comes_from(llama_plan):
    """Independent count: push an array of element numbers through the hooks, crop the device's
    shard, and count the distinct source elements it contains."""
    for device in (jax.devices()[0], jax.devices()[5]):
        for leaf_plan in llama_plan.leaves.values():
            leaf = leaf_plan.leaf
            box = box_from_index(leaf.sharding.devices_indices_map(leaf.shape)[device], leaf.shape)
            n = len(leaf_plan.stack_axes)
            want = 0
            for combo in itertools.product(*(range(a, b) for a, b in box[:n])):
                info = leaf_plan.sources[int(np.ravel_multi_index(combo, leaf_plan.stack_shape)) if n else 0]
                numbers = run_forward(leaf_plan.hooks, np.arange(np.prod(info.shape)).reshape(info.shape))
                want += np.unique(numbers[box_to_slices(box[n:])]).size * info.dtype.itemsize
            assert leaf_plan.process_bytes([device]) == want, leaf.path


def test_every_device_together_needs_the_whole_checkpoint_once(llama_plan):
    devices = jax.devices()
    for leaf_plan in llama_plan.leaves.values():
        assert leaf_plan.process_bytes(devices) == leaf_plan.source_bytes, leaf_plan.path
        assert leaf_plan.ideal_bytes(devices) == leaf_plan.source_bytes, leaf_plan.path


def test_shard_bytes_and_placed_bytes_match_the_shards_jax_makes(llama_plan):
    want: dict[int, int] = {}
    for leaf_plan in llama_plan.leaves.values():
        leaf = leaf_plan.leaf
        placed = jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding)
        sizes = {shard.device.id: shard.data.nbytes for shard in placed.addressable_shards}
        assert leaf_plan.shard_bytes() == max(sizes.values()), leaf.path
        for device, nbytes in sizes.items():
            want[device] = want.get(device, 0) + nbytes
    assert placed_per_device(p.leaf for p in llama_plan.leaves.values()) == dict(sorted(want.items()))


@pytest.mark.parametrize("spec", [P("fsdp", "tp"), P(None, ("fsdp", "tp")), P("tp"), P()])
def test_device_bytes_are_the_bytes_of_each_shard_jax_places(mesh_2x4, spec):
    """Per device, the bytes of the shard JAX's own placement of a real array puts there (a
    replicated dimension: the whole of it on each device); on a set of devices, its distinct shards."""
    leaf = AbstractLeaf("w", (8, 24), np.dtype(np.float32), NamedSharding(mesh_2x4, spec))
    placed = jax.device_put(np.zeros(leaf.shape, leaf.dtype), leaf.sharding)
    assert device_bytes(leaf) == {shard.device: shard.data.nbytes for shard in placed.addressable_shards}
    for devices in (jax.devices(), jax.devices()[:1], jax.devices()[2:7]):  # held_bytes: each distinct shard once
        distinct = {tuple((s.start, s.stop) for s in shard.index): shard.data.nbytes
                    for shard in placed.addressable_shards if shard.device in devices}
        assert held_bytes(leaf, devices) == sum(distinct.values()), devices


def test_device_boxes_are_distinct_and_follow_the_read_sharding(llama_plan, mesh_2x4):
    leaf_plan = next(p for p in llama_plan.leaves.values() if len(p.leaf.shape) == 3)
    boxes = leaf_plan.device_boxes(jax.devices())
    assert len(boxes) == len(set(boxes))
    replicated = jax.sharding.NamedSharding(mesh_2x4, jax.sharding.PartitionSpec())
    assert leaf_plan.device_boxes(jax.devices(), replicated) == [tuple((0, n) for n in leaf_plan.leaf.shape)]


def test_bounding_box_holds_every_box():
    assert bounding_box([((0, 2), (4, 8)), ((1, 5), (0, 3))]) == ((0, 5), (0, 8))
