"""Placing host shards (otfload.place.put) and the shard buffers they come in (otfload.read.arena):
the batched placement (one make_array_from_callback) and per-device puts give the same arrays,
every device holding exactly its numpy reference; large buffers are populated private mappings
that JAX adopts without copying; a shard sent in pieces (accelerators) arrives bit for bit."""

import mmap

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from otfload.place import put
from otfload.read.arena import ALIGNMENT, OWN_MAPPING_BYTES, aligned_empty


@pytest.mark.parametrize("spec", [P("fsdp", "tp"), P(None, "tp"), P()])
@pytest.mark.parametrize("batched", [True, False])
def test_both_ways_place_every_shard(mesh_2x4, spec, batched):
    full = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    sharding = NamedSharding(mesh_2x4, spec)
    indices = sharding.addressable_devices_indices_map(full.shape)
    shards = [np.ascontiguousarray(full[i]) for i in indices.values()]
    if batched:
        out = put._callback_put(full.shape, full.dtype, sharding, shards, list(indices))
    else:
        out = put._public_put(full.shape, sharding, shards, list(indices))
    assert out.shape == full.shape and out.sharding == sharding
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])


def test_a_strided_array_is_copied_in_order():
    a = np.arange(300 * 200, dtype=np.float32).reshape(300, 200)
    out = put.to_host_device(a.T[5:150], jax.devices()[0])
    np.testing.assert_array_equal(np.asarray(out), a.T[5:150])


def test_large_buffers_are_own_mappings_adopted_without_a_copy():
    big = aligned_empty((OWN_MAPPING_BYTES // 4 + 3,), np.float32)
    small = aligned_empty((5,), np.float32)
    assert big.flags.writeable and big.ctypes.data % ALIGNMENT == 0 and small.ctypes.data % ALIGNMENT == 0
    base = big
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap)  # not numpy's (THP-advised) heap
    big[:] = np.arange(big.size, dtype=np.float32)
    device = jax.devices()[0]
    placed = put.to_host_device(big, device)
    assert placed.unsafe_buffer_pointer() == big.ctypes.data  # the shard is this buffer
    del big
    np.testing.assert_array_equal(np.asarray(placed), np.arange(OWN_MAPPING_BYTES // 4 + 3, dtype=np.float32))


@pytest.mark.parametrize("spec", [P(), P("fsdp"), P(None, "tp")])
def test_every_device_owns_its_shard(mesh_2x4, spec):
    full = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
    sharding = NamedSharding(mesh_2x4, spec)
    indices = sharding.addressable_devices_indices_map(full.shape)
    shards = [aligned_empty(full[i].shape, full.dtype) for i in indices.values()]  # one per device, as built
    for shard, i in zip(shards, indices.values(), strict=True):
        shard[...] = full[i]
    out = put.place_shards(full.shape, full.dtype, sharding, shards, list(indices))
    assert len({s.data.unsafe_buffer_pointer() for s in out.addressable_shards}) == 8
    for shard in out.addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), full[shard.index])


@pytest.mark.parametrize(("shape", "piece_bytes"), [((10, 7), 42), ((10, 7), 1), ((33, 4, 3), 100), ((5,), 4)])
@pytest.mark.parametrize("dtype", [ml_dtypes.bfloat16, np.float32, np.int8, ml_dtypes.float8_e4m3fn])
def test_a_shard_sent_in_pieces_arrives_bit_for_bit(shape, piece_bytes, dtype):
    """Row blocks (the last one overlapping the one before) of random bits, NaN payloads included."""
    itemsize = np.dtype(dtype).itemsize
    raw = np.random.default_rng(0).integers(0, 256, size=(*shape, itemsize), dtype=np.uint8)
    array = raw.view(dtype).reshape(shape)
    out = put.piecewise_put(array, jax.devices()[0], piece_bytes)
    assert out.shape == array.shape and out.dtype == array.dtype
    assert np.asarray(out).tobytes() == array.tobytes()


def test_a_signalling_nan_is_not_quieted_on_the_way():
    """A float write (XLA's CPU backend computes bf16 in f32) would turn 0x7FBF into 0x7FC0."""
    bits = np.full((12, 4), 0x3F80, np.uint16)
    bits[[1, 6, 11], 2] = 0x7FBF
    out = put.piecewise_put(bits.view(ml_dtypes.bfloat16), jax.devices()[0], 3 * 4 * 2)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), bits)


@pytest.mark.parametrize(
    ("array", "piece_bytes"),
    [(np.float32(3.5), 4), (np.arange(6, dtype=np.float32).reshape(2, 3), 24), (np.array([True, False] * 8), 4)],
    ids=["scalar", "fits-one-piece", "bool"],
)
def test_what_needs_no_pieces_goes_whole(array, piece_bytes):
    array = np.asarray(array)
    out = put.piecewise_put(array, jax.devices()[0], piece_bytes)
    assert np.asarray(out).tobytes() == array.tobytes() and out.dtype == array.dtype
