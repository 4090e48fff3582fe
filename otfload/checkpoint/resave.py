"""Re-save a native checkpoint in the layout of a target mesh, so restoring onto it needs no resharding.

Orbax writes each array in chunks of its per-device shard shape; a restore whose shards straddle
those chunks reads and reassembles far more than it keeps. Resharding rewrites the chunks once.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from otfload.checkpoint.config import CheckpointConfig
from otfload.checkpoint.metadata import LayoutMetadata, mesh_axes_of
from otfload.checkpoint.orbax_manager import OrbaxCheckpointManager
from otfload.checkpoint.paths import unflatten_tree
from otfload.checkpoint.protocol import resolve_checkpoint_scan_layers
from otfload.plan.sharding import DEFAULT_RULES, LogicalRules, logical_to_sharding, make_mesh

DEFAULT_PART_BYTES = 256 * 2**20


def fallback_spec(shape: Sequence[int], mesh: Mesh) -> PartitionSpec:
    """Shard the largest dimension divisible by the first mesh axis on that axis; else replicate."""
    axis = mesh.axis_names[0]
    size = mesh.shape[axis]
    dims = [d for d, n in enumerate(shape) if n % size == 0]
    if size == 1 or not dims:
        return PartitionSpec()  # type: ignore[no-untyped-call]  # jax: unannotated __init__
    dim = max(dims, key=lambda d: shape[d])
    return PartitionSpec(*([None] * dim), axis)  # type: ignore[no-untyped-call]  # as above


def target_sharding(
    path: str, shape: Sequence[int], layout: LayoutMetadata, mesh: Mesh, rules: LogicalRules
) -> NamedSharding:
    """Leaf ``path``'s sharding on ``mesh``: from its recorded logical axes, else :func:`fallback_spec`."""
    axes = layout.logical_axes.get(path)
    if axes is not None:
        return logical_to_sharding(axes, shape, mesh, rules)
    return NamedSharding(mesh, fallback_spec(shape, mesh))


def _parts(leaves: Mapping[str, jax.ShapeDtypeStruct], max_bytes: int) -> Iterator[dict[str, Any]]:
    """Consecutive groups of leaves of at most ``max_bytes`` each (a larger leaf goes alone)."""
    group: dict[str, jax.ShapeDtypeStruct] = {}
    size = 0
    for path, leaf in leaves.items():
        nbytes = int(np.prod(leaf.shape)) * np.dtype(leaf.dtype).itemsize
        if group and size + nbytes > max_bytes:
            yield unflatten_tree(group)
            group, size = {}, 0
        group[path] = leaf
        size += nbytes
    if group:
        yield unflatten_tree(group)


def reshard_checkpoint(
    src_dir: str | os.PathLike[str],
    dst_dir: str | os.PathLike[str],
    mesh_axes: Mapping[str, int],
    rules: LogicalRules = DEFAULT_RULES,
    *,
    step: int | None = None,
    scan_layers: bool | None = None,
    max_part_bytes: int = DEFAULT_PART_BYTES,
    devices: Sequence[jax.Device] | None = None,
) -> int:
    """Re-save ``step`` (default: the latest) of ``src_dir`` into ``dst_dir`` sharded for ``mesh_axes``.

    Leaves are restored straight onto the target mesh and written ``max_part_bytes`` at a time, so
    host memory stays near one part (or the largest leaf). The layout metadata is kept, with
    ``mesh_axes`` updated; ``scan_layers`` is checked with the usual rule. Returns the step written.
    """
    mesh = make_mesh(dict(mesh_axes), devices)
    source = OrbaxCheckpointManager(CheckpointConfig(src_dir, async_save=False))
    target = OrbaxCheckpointManager(CheckpointConfig(dst_dir, max_to_keep=None, async_save=False))
    try:
        step = source.resolve_step(step)
        resolved = resolve_checkpoint_scan_layers(source, scan_layers, step)
        layout = source.metadata(step) or LayoutMetadata()
        leaves = {
            path: jax.ShapeDtypeStruct(  # type: ignore[no-untyped-call]  # jax: unannotated __init__
                spec.shape, spec.dtype, sharding=target_sharding(path, spec.shape, layout, mesh, rules)
            )
            for path, spec in source.leaf_specs(step).items()
        }
        parts = (source.restore_leaves(step, group) for group in _parts(leaves, max_part_bytes))
        new_layout = layout.replace(scan_layers=resolved, mesh_axes=mesh_axes_of(mesh))
        target.save_in_parts(step, parts, metadata=new_layout)
    finally:
        source.close()
        target.close()
    return step
