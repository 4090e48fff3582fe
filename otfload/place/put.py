"""Host arrays onto devices with one C++ call each: the place step's per-leaf overhead.

``jax.device_put`` of a numpy array costs ~0.2 ms of Python per call before any byte moves
(abstractify, sharding checks, dispatch), and a leaf placed shard by shard then joined by
``jax.make_array_from_single_device_arrays`` pays it once per device: on the 1 GiB Llama bench
(163 leaves × 8 devices) ~0.3 CPU-seconds, a quarter of the whole load. JAX's own ``device_put``
ends in ``xla_client.batched_device_put(aval, sharding, shards, devices)``, which builds the
global array from every local shard in one call (~15 µs): :func:`place_shards` calls it directly.

That function is not public API. It is looked up once, checked on a tiny array, and where it is
missing or behaves differently (another jax version) the public calls are used instead, with the
same result. Either way JAX's CPU backend adopts 64-byte-aligned numpy buffers without copying.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import numpy as np

# (shape, dtype, sharding, shards, devices) -> the global array
Put = Callable[[tuple[int, ...], np.dtype, jax.sharding.Sharding, Sequence[np.ndarray], Sequence[jax.Device]],
               jax.Array]


def _public_put(shape, dtype, sharding, arrays, devices) -> jax.Array:
    shards = [jax.device_put(a, d) for a, d in zip(arrays, devices, strict=True)]
    return jax.make_array_from_single_device_arrays(shape, sharding, shards)


def _batched_put(shape, dtype, sharding, arrays, devices) -> jax.Array:
    from jax._src import core
    from jax._src.lib import xla_client

    aval = core.ShapedArray(shape, dtype)
    return xla_client.batched_device_put(aval, sharding, list(arrays), list(devices), True)


@functools.cache
def _put() -> Put:
    """The batched call where it exists and gives what the public calls give, else the public calls."""
    try:
        device = jax.local_devices()[0]
        probe = np.arange(6, dtype=np.float32).reshape(2, 3)
        sharding = jax.sharding.SingleDeviceSharding(device)
        out = _batched_put(probe.shape, probe.dtype, sharding, [probe], [device])
        if isinstance(out, jax.Array) and out.sharding == sharding and np.array_equal(np.asarray(out), probe):
            return _batched_put
    except Exception:  # noqa: BLE001 - any failure of the private call means: use the public one
        pass
    return _public_put


def place_shards(
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: jax.sharding.Sharding,
    arrays: Sequence[np.ndarray],
    devices: Sequence[jax.Device],
) -> jax.Array:
    """The global array of ``shape`` with ``sharding`` whose shard on ``devices[i]`` (every
    addressable device, in ``sharding.addressable_devices_indices_map`` order) is ``arrays[i]``."""
    if len(devices) > 1 and sharding.is_fully_replicated:
        # The batched call makes a fully replicated array from arrays[0] alone, and on CPU every
        # device then aliases that one buffer; each device must own its shard (donation writes it).
        return _public_put(shape, dtype, sharding, arrays, devices)
    return _put()(shape, np.dtype(dtype), sharding, arrays, devices)


def to_host_device(array: np.ndarray, device: jax.Device) -> jax.Array:
    """``jax.device_put(array, device)`` (a strided ``array`` is copied by XLA's host transpose)."""
    return place_shards(array.shape, array.dtype, jax.sharding.SingleDeviceSharding(device), [array], [device])
