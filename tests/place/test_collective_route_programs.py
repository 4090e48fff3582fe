"""Reshard programs compiled ahead (otfload/place/collective_route.py, ReshardPrograms): one per distinct
shape, dtype and pair of shardings, compiled in the background before the reshard asks for it, and
moving a band to its target sharding exactly as numpy says (issue 34: the compile leaves the choice)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from otfload.place.collective_route import ReshardPrograms


def test_each_signature_is_compiled_once_ahead_and_reshards_exactly():
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    band = NamedSharding(mesh, PartitionSpec(("fsdp", "tp"), None))  # contiguous rows per device
    target = NamedSharding(mesh, PartitionSpec(None, "tp"))  # column blocks
    want = np.arange(64 * 32, dtype=np.float32).reshape(64, 32).astype(jnp.bfloat16)
    leaf = types.SimpleNamespace(leaf=types.SimpleNamespace(shape=want.shape, dtype=want.dtype, sharding=target))
    programs = ReshardPrograms({"a": leaf, "b": leaf}, {"a": band, "b": band})  # type: ignore[dict-item]
    try:
        assert len(programs._programs) == 1  # two leaves of one signature: one compile
        (compiled,) = programs._programs.values()
        compiled.result(timeout=120)  # done in the background, before any reshard asks
        for _ in range(2):
            array = jax.make_array_from_callback(want.shape, band, lambda index: want[index])
            moved = programs.reshard(array, target)
            assert moved.sharding == target
            np.testing.assert_array_equal(np.asarray(moved), want)
            for shard in moved.addressable_shards:  # each device its column block
                np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    finally:
        programs.close()
