"""Leaves a mesh replicates because it divides none of their dimensions, and the warning a load gives.

A logical axis whose mesh axes do not divide its dimension is replicated
(:func:`otfload.plan.sharding.logical_to_spec`): ``--mesh fsdp=3`` on a model whose sizes are powers
of two shards nothing, and every device then holds a full copy of every weight. That is a valid
load, but rarely the one asked for, so :func:`warn_replicated` says so once per load when they
hold a noticeable share of the model (:class:`ReplicatedLeavesWarning`: the count, the first few
leaves, the bytes) and ``otfload inspect`` marks every such leaf (:func:`replicated_leaves`).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

from jax.sharding import Mesh, NamedSharding

from otfload.plan.abstract import AbstractLeaf
from otfload.plan.leaf_bytes import shard_bytes
from otfload.plan.sharding import DEFAULT_RULES, LogicalRules, logical_to_spec

SHOWN = 3  # leaves named in the warning; the rest are counted
# The share of the model's bytes replicated for want of a dividing axis that a load warns about: a
# few small leaves (GQA's key/value biases when the KV heads are fewer than ``tp``) are the usual
# price of a mesh, whole weights copied to every device are not (inspect marks every one).
WARN_SHARE = 0.01


class ReplicatedLeavesWarning(UserWarning):
    """The mesh divides no dimension of some leaves their logical axes would shard: each is copied
    whole to every device."""


@dataclass(frozen=True)
class Replicated:
    """The leaves (dotted paths, in plan order) replicated for want of a dividing mesh axis, and their bytes."""

    paths: tuple[str, ...]
    nbytes: int

    def message(self, mesh: Mapping[str, int]) -> str:
        """The warning's text."""
        more = len(self.paths) - SHOWN
        names = ", ".join(self.paths[:SHOWN]) + (f" and {more} more" if more > 0 else "")
        return (f"mesh {dict(mesh)} divides no dimension of {len(self.paths)} leaves their logical axes shard "
                f"({names}): each is replicated on every device, {self.nbytes:,} bytes per device; choose axis "
                "sizes that divide the model's dimensions")


def replicated_by_mesh(leaf: AbstractLeaf, rules: LogicalRules = DEFAULT_RULES) -> bool:
    """Whether ``leaf`` is fully replicated on a mesh of several devices although its logical axes
    would shard some dimension on a mesh that divided it."""
    sharding = leaf.sharding
    if not isinstance(sharding, NamedSharding) or leaf.logical_axes is None or not sharding.is_fully_replicated:
        return False
    if len(leaf.logical_axes) != len(leaf.shape):  # names for some dims only (a stacked leaf): no rule to judge by
        return False
    mesh = sharding.mesh
    if not isinstance(mesh, Mesh) or mesh.size < 2:
        return False
    divisible = [mesh.size] * len(leaf.shape)  # every dimension divisible: what the rules ask for
    wanted = logical_to_spec(leaf.logical_axes, divisible, mesh, rules)
    return any(axes is not None for axes in wanted)


def replicated_leaves(leaves: Mapping[str, AbstractLeaf], rules: LogicalRules | None = None) -> Replicated:
    """The leaves of ``leaves`` (path -> leaf) that :func:`replicated_by_mesh` finds."""
    found = [leaf for leaf in leaves.values() if replicated_by_mesh(leaf, DEFAULT_RULES if rules is None else rules)]
    nbytes = sum(shard_bytes(leaf) for leaf in found)  # each whole on every device
    return Replicated(tuple(leaf.path for leaf in found), nbytes)


def warn_replicated(leaves: Mapping[str, AbstractLeaf], rules: LogicalRules | None = None) -> Replicated:
    """:func:`replicated_leaves`, with one :class:`ReplicatedLeavesWarning` when they hold at least
    :data:`WARN_SHARE` of the leaves' bytes."""
    found = replicated_leaves(leaves, rules)
    total = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves.values())
    if found.paths and found.nbytes >= WARN_SHARE * total:
        mesh = next(leaf.sharding.mesh for leaf in leaves.values() if isinstance(leaf.sharding, NamedSharding))
        warnings.warn(found.message(mesh.shape), ReplicatedLeavesWarning, stacklevel=3)
    return found


__all__ = ["Replicated", "ReplicatedLeavesWarning", "replicated_by_mesh", "replicated_leaves", "warn_replicated"]
