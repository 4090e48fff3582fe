"""Leaf arrays of a model or pytree, and host copies of one slice of a sharded leaf.

:func:`gather_slice` copies one position of a leaf's stack dims — one layer of a scanned weight, or
the whole leaf — from the device shards that hold it (a :data:`Position` names an index for each
dim taken and ``None`` for each dim kept: ``(3,)`` is ``x[3]``, ``(None, 3)`` is ``x[:, 3]``, the
layer axis of a MaxText leaf scanned on its second dim), one shard at a time, so host
memory holds only that slice. Each distinct shard is read once, from whichever replica this
process holds. On CPU a shard is viewed in place (no copy); on accelerators the slice is cut on
the device (one compiled indexing function per shard shape, the position is traced) and only it
is transferred.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
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


Position = tuple[int | None, ...]


def taken_dims(index: Position) -> tuple[int, ...]:
    """The dims ``index`` takes one position of (the others are kept whole)."""
    return tuple(d for d, i in enumerate(index) if i is not None)


def kept_shape(shape: tuple[int, ...], index: Position) -> tuple[int, ...]:
    """The shape of ``array[index]`` for an array of ``shape``."""
    return tuple(n for d, n in enumerate(shape) if d >= len(index) or index[d] is None)


def contains(spans: Sequence[tuple[int, int]], index: Position) -> bool:
    """Whether the box ``spans`` holds the positions ``index`` takes."""
    return all(i is None or a <= i < b for i, (a, b) in zip(index, spans, strict=False))


def _local_range(index: slice, n: int) -> tuple[int, int]:
    start, stop, _ = index.indices(n)
    return start, stop


@functools.partial(jax.jit, static_argnums=2)
def _index(data: jax.Array, position: jax.Array, dims: tuple[int, ...]) -> jax.Array:
    for k in reversed(range(len(dims))):  # the last dim first: the earlier dims keep their numbers
        data = jax.lax.dynamic_index_in_dim(data, position[k], axis=dims[k], keepdims=False)
    return data


def device_slice(array: jax.Array, index: Position) -> jax.Array:
    """``array[index]`` computed where ``array`` lives (every process of a multi-process array must
    call it); one compiled function per leaf shape and taken dims, the position is traced."""
    dims = taken_dims(index)
    if not dims:
        return array
    sliced: jax.Array = _index(array, np.asarray([index[d] for d in dims], np.int32), dims)
    return sliced


def _numpy_index(index: Position) -> tuple[int | slice, ...]:
    return tuple(slice(None) if i is None else i for i in index)


def _take(data: jax.Array, position: Position) -> np.ndarray:
    """``data[position]`` of a single-device array, as a host array."""
    if not taken_dims(position):
        return np.asarray(data)
    if data.devices().pop().platform == "cpu":
        host: np.ndarray = np.asarray(data)[_numpy_index(position)]
        return host
    return np.asarray(device_slice(data, position))


def gather_slice(array: Any, index: Position) -> np.ndarray:
    """A host copy of ``array[index]`` (a :data:`Position`), read shard by shard."""
    if not isinstance(array, jax.Array):
        return np.asarray(array[_numpy_index(index)])
    out = np.empty(kept_shape(array.shape, index), array.dtype)
    filled, seen = 0, set()
    for shard in array.addressable_shards:
        spans = tuple(_local_range(s, n) for s, n in zip(shard.index, array.shape, strict=True))
        if spans in seen or not contains(spans, index):
            continue
        seen.add(spans)
        local = tuple(None if i is None else i - a for i, (a, _) in zip(index, spans, strict=False))
        piece = _take(shard.data, local)
        kept = [span for d, span in enumerate(spans) if d >= len(index) or index[d] is None]
        out[tuple(slice(a, b) for a, b in kept)] = piece
        filled += piece.size
    if filled != out.size:
        raise OtfloadError(
            "this process does not hold every shard of the slice being exported; in a multi-process "
            "job every process must call the export (see otfload.export.distributed)"
        )
    return out
