"""Leaf arrays of a model or pytree, and host copies of one slice of a sharded leaf.

:func:`gather_slice` copies one position of a leaf's leading (stack) dims — one layer of a scanned
weight, or the whole leaf — from the device shards that hold it, one shard at a time, so host
memory holds only that slice. Each distinct shard is read once, from whichever replica this
process holds. On CPU a shard is viewed in place (no copy); on accelerators the slice is cut on
the device (one compiled indexing function per shard shape, the position is traced) and only it
is transferred.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from otfload.errors import OtfloadError
from otfload.plan.abstract import dotted


def leaf_arrays(model_or_params: Any) -> dict[str, Any]:
    """Dotted leaf path → array, for an NNX module (its ``nnx.Param`` s) or any pytree of arrays."""
    if isinstance(model_or_params, nnx.Module):
        state = nnx.state(model_or_params, nnx.Param)
        return {dotted(path): var.get_value() for path, var in nnx.to_flat_state(state)}
    flat, _ = jax.tree_util.tree_flatten_with_path(model_or_params)
    return {dotted(path): getattr(leaf, "value", leaf) for path, leaf in flat}


def _local_range(index: slice, n: int) -> tuple[int, int]:
    start, stop, _ = index.indices(n)
    return start, stop


@jax.jit
def _index(data: jax.Array, position: jax.Array) -> jax.Array:
    return data[tuple(position)]


def device_slice(array: jax.Array, index: tuple[int, ...]) -> jax.Array:
    """``array[index]`` computed where ``array`` lives (every process of a multi-process array must
    call it); one compiled function per leaf shape, the position is traced."""
    return _index(array, np.asarray(index, np.int32)) if index else array


def _take(data: jax.Array, position: tuple[int, ...]) -> np.ndarray:
    """``data[position]`` of a single-device array, as a host array."""
    if not position:
        return np.asarray(data)
    if data.devices().pop().platform == "cpu":
        host: np.ndarray = np.asarray(data)[position]
        return host
    return np.asarray(device_slice(data, position))


def gather_slice(array: Any, index: tuple[int, ...]) -> np.ndarray:
    """A host copy of ``array[index]`` (``index`` addresses leading dims), read shard by shard."""
    if not isinstance(array, jax.Array):
        return np.asarray(array[index])
    lead = len(index)
    out = np.empty(array.shape[lead:], array.dtype)
    filled, seen = 0, set()
    for shard in array.addressable_shards:
        spans = tuple(_local_range(s, n) for s, n in zip(shard.index, array.shape, strict=True))
        if spans in seen or not all(a <= i < b for i, (a, b) in zip(index, spans, strict=False)):
            continue
        seen.add(spans)
        local = tuple(i - a for i, (a, _) in zip(index, spans, strict=False))
        piece = _take(shard.data, local)
        out[tuple(slice(a, b) for a, b in spans[lead:])] = piece
        filled += piece.size
    if filled != out.size:
        raise OtfloadError(
            "this process does not hold every shard of the slice being exported; in a multi-process "
            "job every process must call the export (see otfload.export.distributed)"
        )
    return out
