"""Host arrays onto devices with one call per leaf: the place step's per-leaf overhead.

``jax.device_put`` of a numpy array costs ~0.2 ms of Python per call before any byte moves
(abstractify, sharding checks, dispatch), and a leaf placed shard by shard then joined by
``jax.make_array_from_single_device_arrays`` pays it once per device: on the 1 GiB Llama bench
(163 leaves × 8 devices) ~0.3 CPU-seconds, a quarter of the whole load.
``jax.make_array_from_callback`` asks for every local shard and hands them all to XLA in one
batched call: :func:`place_shards` serves it the shards already built, each device its own buffer.
JAX's CPU backend adopts 64-byte-aligned numpy buffers without copying; a strided (transposed)
array is copied by XLA's host transpose.

An accelerator copies what it is given through pinned host memory that JAX allocates when it first
needs it and keeps (on an H200: a fresh process's first 2 GiB ``device_put`` moved 1.1 GB/s and
left 3.3 GiB of it resident, the second 9.1 GB/s; ``benchmarks/h2d_routes.py``). A shard larger
than :data:`DEVICE_PIECE_BYTES` therefore goes over in pieces of that size, each written into one
device buffer as it arrives (a donated ``dynamic_update_slice``), at most :data:`PIECES_IN_FLIGHT`
of them staged at once.
"""

from __future__ import annotations

import functools
from collections import deque
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from otfload.plan.boxes import Box, box_from_index
from otfload.plan.leaf_bytes import addressable_boxes

# Shards of accelerators larger than this go over in pieces of this size (None: one device_put each).
# 4 GiB Llama onto an H200, same run (docs/benchmarks.md, "Into GPU memory"): 5.29 s and 6.6 GiB peak
# host memory in 64 MiB pieces, 6.81 s and 10.5 GiB with one device_put per shard.
DEVICE_PIECE_BYTES: int | None = 64 << 20
# Pieces of one shard staged at once: the next is copied while the last is written.
PIECES_IN_FLIGHT = 4


@functools.cache
def _row_writer() -> Callable[[jax.Array, jax.Array, int], jax.Array]:
    """``buf`` with ``part`` written at row ``row`` (``buf`` donated: updated in place)."""
    return jax.jit(lambda buf, part, row: jax.lax.dynamic_update_slice_in_dim(buf, part, row, 0), donate_argnums=0)


@functools.cache
def _bits_as(dtype: np.dtype) -> Callable[[jax.Array], jax.Array]:
    return jax.jit(lambda bits: jax.lax.bitcast_convert_type(bits, dtype), donate_argnums=0)


def _whole_bytes(dtype: np.dtype) -> bool:
    """Whether ``dtype`` is a number filling its bytes (so an unsigned integer view carries it)."""
    number = jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)
    held = jax.dtypes.canonicalize_dtype(dtype) == dtype  # float64 without x64 is converted, not carried
    whole = jax.dtypes.itemsize_bits(dtype) == 8 * dtype.itemsize  # not int4, float4 (packed on devices)
    return number and held and whole and dtype.itemsize in (1, 2, 4, 8)


def piecewise_put(array: np.ndarray, device: jax.Device, piece_bytes: int) -> jax.Array:
    """``jax.device_put(array, device)`` in row blocks of about ``piece_bytes`` (one block, at least
    one row), each written into one device buffer; the last block ends at the last row (overlapping
    the one before), so every block has one shape and the writer compiles once per shard shape.
    Blocks move as unsigned integers of the same width: a float write may quiet a NaN's bits."""
    n = array.shape[0] if array.ndim else 0
    rows = min(n, max(1, piece_bytes // max(1, array.nbytes // max(1, n))))
    if rows == n or not _whole_bytes(array.dtype):
        whole: jax.Array = jax.device_put(array, device)
        return whole
    bits = array.view(f"u{array.dtype.itemsize}")
    buf = jnp.zeros(bits.shape, bits.dtype, device=device)
    staged: deque[jax.Array] = deque()
    for start in range(0, n, rows):
        start = min(start, n - rows)
        part = jax.device_put(bits[start : start + rows], device)
        buf = _row_writer()(buf, part, start)
        staged.append(part)
        if len(staged) > PIECES_IN_FLIGHT:
            staged.popleft().block_until_ready()
    return buf if bits.dtype == array.dtype else _bits_as(array.dtype)(buf)


def _public_put(
    shape: tuple[int, ...], sharding: jax.sharding.Sharding, arrays: Sequence[np.ndarray],
    devices: Sequence[jax.Device],
) -> jax.Array:
    piece = DEVICE_PIECE_BYTES
    shards = [
        piecewise_put(a, d, piece) if piece is not None and d.platform != "cpu" else jax.device_put(a, d)
        for a, d in zip(arrays, devices, strict=True)
    ]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _callback_put(
    shape: tuple[int, ...], dtype: np.dtype, sharding: jax.sharding.Sharding, arrays: Sequence[np.ndarray],
    devices: Sequence[jax.Device],
) -> jax.Array:
    box_of = dict(addressable_boxes(shape, sharding))
    by_box: dict[Box, list[np.ndarray]] = {}  # devices with equal boxes (replicated axes): one array each
    for device, array in zip(devices, arrays, strict=True):
        by_box.setdefault(box_of[device], []).append(array)

    def shard(index: tuple[slice, ...] | None) -> np.ndarray:
        return by_box[box_from_index(index or (), shape)].pop()

    return jax.make_array_from_callback(shape, sharding, shard, dtype=dtype)


def place_shards(
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: jax.sharding.Sharding,
    arrays: Sequence[np.ndarray],
    devices: Sequence[jax.Device],
) -> jax.Array:
    """The global array of ``shape`` with ``sharding`` whose shard on ``devices[i]`` (every
    addressable device, in ``sharding.addressable_devices_indices_map`` order) is ``arrays[i]``."""
    if DEVICE_PIECE_BYTES is not None and any(d.platform != "cpu" for d in devices):
        return _public_put(shape, sharding, arrays, devices)
    if len(devices) > 1 and sharding.is_fully_replicated:
        # make_array_from_callback builds a fully replicated array from one value, and on CPU every
        # device then aliases that one buffer; each device must own its shard (donation writes it).
        return _public_put(shape, sharding, arrays, devices)
    return _callback_put(shape, np.dtype(dtype), sharding, arrays, devices)


def to_host_device(array: np.ndarray, device: jax.Device) -> jax.Array:
    """``jax.device_put(array, device)`` (a strided ``array`` is copied by XLA's host transpose)."""
    return place_shards(array.shape, array.dtype, jax.sharding.SingleDeviceSharding(device), [array], [device])
