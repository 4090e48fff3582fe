"""Small sharded trees and assertions shared by the native-checkpoint tests."""

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

NUM_LAYERS = 3


def scanned_state(mesh, seed: int = 0) -> dict:
    """A tiny scanned parameter tree, sharded on ``mesh`` (values depend on ``seed``)."""
    rng = np.random.default_rng(seed)

    def put(shape, spec):
        value = rng.standard_normal(shape).astype(np.float32)
        return jax.device_put(value, NamedSharding(mesh, PartitionSpec(*spec)))

    return {
        "model": {
            "embed": {"embedding": put((16, 8), ("tp", "fsdp"))},
            "layers": {
                "attn": {"kernel": put((NUM_LAYERS, 8, 16), (None, "fsdp", "tp"))},
                "norm": {"scale": put((NUM_LAYERS, 8), (None, "fsdp"))},
            },
        }
    }


def abstract(tree):
    """The ``ShapeDtypeStruct`` tree (with shardings) of ``tree``."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def assert_trees_equal(actual, expected):
    """Same structure, bit-identical values and equal shardings."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(e))
        assert a.dtype == e.dtype
        assert a.sharding.is_equivalent_to(e.sharding, a.ndim), (a.sharding, e.sharding)


def unscanned_state(mesh, seed: int = 0) -> dict:
    """The per-layer (unscanned) counterpart of :func:`scanned_state`'s shapes."""
    rng = np.random.default_rng(seed)
    sharding = NamedSharding(mesh, PartitionSpec("fsdp", "tp"))
    layers = {
        str(i): {
            "attn": {"kernel": jax.device_put(rng.standard_normal((8, 16)).astype(np.float32), sharding)}
        }
        for i in range(NUM_LAYERS)
    }
    return {"model": {"layers": layers}}
