"""The abstract target: every parameter leaf's path, shape, dtype and ``NamedSharding``, with no
weight allocated.

Two ways in: an NNX model built under ``nnx.eval_shape`` whose ``nnx.Param`` s carry logical axis
names (``logical_axes=`` or Flax's ``sharding_names=``), turned into shardings by rules; or any
pytree of ``jax.ShapeDtypeStruct`` with ``.sharding`` (Linen, Equinox, MaxText users). Leaf paths
are dotted strings (``layers.attn.q.kernel``) — what mapping tables match.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NamedTuple

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from otfload.errors import MappingError
from otfload.plan.sharding import DEFAULT_RULES, LogicalRules, logical_to_sharding


class AbstractLeaf(NamedTuple):
    """One target leaf: what it must look like once loaded."""

    path: str
    shape: tuple[int, ...]
    dtype: np.dtype
    sharding: Sharding
    logical_axes: tuple[str | None, ...] | None = None


def dotted(path: Iterable[Any]) -> str:
    """A pytree/NNX path as a dotted string."""
    parts = []
    for key in path:
        for attr in ("key", "name", "idx"):
            if hasattr(key, attr):
                key = getattr(key, attr)
                break
        parts.append(str(key))
    return ".".join(parts)


def _axes_of(variable: nnx.Variable) -> tuple[str | None, ...] | None:
    meta = variable.get_metadata()
    for name in ("logical_axes", "sharding_names", "sharding"):
        axes = meta.get(name)
        if axes is not None and not isinstance(axes, Sharding):
            return tuple(axes)
    return None


def abstract_from_nnx(
    model: nnx.Module, mesh: Mesh, rules: LogicalRules = DEFAULT_RULES
) -> dict[str, AbstractLeaf]:
    """Abstract leaves of an NNX model's ``nnx.Param`` s (built under ``nnx.eval_shape``)."""
    leaves = {}
    for path, variable in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        value = variable.get_value()
        axes = _axes_of(variable)
        shape = tuple(value.shape)
        sharding = logical_to_sharding(axes, shape, mesh, rules)
        key = dotted(path)
        leaves[key] = AbstractLeaf(key, shape, np.dtype(value.dtype), sharding, axes)
    return leaves


def abstract_from_pytree(tree: Any, mesh: Mesh | None = None) -> tuple[dict[str, AbstractLeaf], Any]:
    """Abstract leaves of a pytree of ``ShapeDtypeStruct`` (or arrays); returns them and the treedef.

    A leaf without a sharding is replicated on ``mesh`` (which is then required).
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(tree)
    leaves = {}
    for path, leaf in flat:
        key = dotted(path)
        sharding = getattr(leaf, "sharding", None)
        if sharding is None:
            if mesh is None:
                raise MappingError(f"leaf {key!r} has no sharding and no mesh was given")
            sharding = NamedSharding(mesh, PartitionSpec())
        leaves[key] = AbstractLeaf(key, tuple(leaf.shape), np.dtype(leaf.dtype), sharding)
    return leaves, treedef
