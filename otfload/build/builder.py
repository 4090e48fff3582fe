"""Build and place leaves: each device shard from exactly the bytes it needs, with one ``np.stack``.

For a leaf and one of its shards (a box of the leaf):

1. the leading stack dims of the box pick which HF tensors (layers, experts) the shard needs;
2. the rest of the box is carried backwards through the hooks to the box of each HF tensor that
   covers it, and only those byte runs are read (into reusable scratch);
3. each piece goes forwards through the hooks (views where possible) and is cropped to the box;
4. one ``np.stack`` writes every piece, cast to the target dtype, into a fresh 64-byte-aligned
   buffer — the only full copy of the data — which JAX's CPU backend adopts without copying.

Devices that hold the same box (replicated dims) share one build; each gets its own buffer, so no
two devices alias memory that a donating computation might overwrite.
"""

from __future__ import annotations

import itertools
from collections import defaultdict

import jax
import numpy as np

from otfload.plan.boxes import Box, box_from_index, box_shape, crop
from otfload.plan.hooks import chain_apply, chain_needed
from otfload.plan.planner import LeafPlan
from otfload.read.arena import Arena, aligned_empty
from otfload.read.reader import TensorReader


def build_box(plan: LeafPlan, box: Box, reader: TensorReader, arena: Arena) -> np.ndarray:
    """The values of ``plan``'s leaf inside ``box``, in a fresh aligned array of the target dtype."""
    n_stack = len(plan.stack_axes)
    stack_box, inner = box[:n_stack], box[n_stack:]
    strides = [int(np.prod(plan.stack_shape[d + 1 :], dtype=np.int64)) for d in range(n_stack)]
    need = chain_needed(plan.hooks, plan.shapes, inner)
    pieces = []
    for combo in itertools.product(*(range(a, b) for a, b in stack_box)):
        info = plan.sources[sum(i * s for i, s in zip(combo, strides, strict=True))]
        part = reader.read_box(info, need, arena)
        out, have = chain_apply(plan.hooks, plan.shapes, part, need)
        pieces.append(crop(out, have, inner))
    result = aligned_empty(box_shape(box), plan.leaf.dtype)
    if n_stack == 0:
        np.copyto(result, pieces[0], casting="unsafe")
    else:
        np.stack(pieces, axis=0, out=result.reshape((-1, *box_shape(inner))), casting="unsafe")
    arena.reset()
    return result


def build_leaf(plan: LeafPlan, reader: TensorReader, arena: Arena) -> jax.Array:
    """The leaf as a ``jax.Array`` with its target sharding, built shard by shard."""
    leaf = plan.leaf
    devices_by_box: dict[Box, list] = defaultdict(list)
    for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
        devices_by_box[box_from_index(index, leaf.shape)].append(device)
    arrays = []
    for box, devices in devices_by_box.items():
        data = build_box(plan, box, reader, arena)
        for i, device in enumerate(devices):
            own = data if i == 0 else _aligned_copy(data)
            arrays.append(jax.device_put(own, device))
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, arrays)


def _aligned_copy(data: np.ndarray) -> np.ndarray:
    out = aligned_empty(data.shape, data.dtype)
    np.copyto(out, data)
    return out
