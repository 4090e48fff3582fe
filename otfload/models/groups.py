"""Layer stacks of mixed kinds: each kind of layer is a group of its own shapes (one stacked module
with ``scan_layers``, else an ``nnx.List``), and a forward pass runs the groups in HF layer order, one
run of consecutive layers of a group at a time (Nemotron-H's Mamba-2, attention, MLP and MoE blocks).

A layer's *position* is its index among its group's layers (what the mapping's config lists index);
a group's cache has a leading axis over its positions, and groups without one (feed-forward blocks)
have none.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from otfload.models.base import GroupCache, GroupCaches
from otfload.models.layers import Params, pure, run_layers

# ``forward(group, params, x, cache) -> (x, updated cache)``: one layer of ``group``.
GroupForward = Callable[[str, Params, jax.Array, GroupCache | None], tuple[jax.Array, GroupCache | None]]


def layer_runs(groups: Sequence[str]) -> list[tuple[str, int, int]]:
    """Runs of consecutive layers of one group, from each HF layer's group in order: ``(group, first
    position, stop position)``."""
    runs: list[tuple[str, int, int]] = []
    seen: dict[str, int] = {}
    for group in groups:
        pos = seen.get(group, 0)
        seen[group] = pos + 1
        if runs and runs[-1][0] == group:
            runs[-1] = (group, runs[-1][1], pos + 1)
        else:
            runs.append((group, pos, pos + 1))
    return runs


def group_params(layers: nnx.Module, start: int, stop: int) -> Params | list[Params]:
    """The parameters of positions ``start .. stop - 1`` of a group: sliced from its stack, or a
    list of per-layer dicts from its ``nnx.List``."""
    if isinstance(layers, nnx.List):
        return [pure(layers[i]) for i in range(start, stop)]
    sliced: Params = jax.tree.map(lambda a: a[start:stop], pure(layers))
    return sliced


def run_groups(
    groups: Mapping[str, nnx.Module], order: Sequence[str], x: jax.Array, caches: Mapping[str, GroupCache] | None,
    forward: GroupForward,
) -> tuple[jax.Array, GroupCaches | None]:
    """``x`` through every layer, HF layer ``i`` being the next position of group ``order[i]``:
    ``(x, the updated caches of the groups that have one)`` (None without ``caches``)."""
    pieces: dict[str, list[GroupCache]] = {}
    for group, start, stop in layer_runs(order):
        cache = None
        if caches is not None and group in caches:
            cache = jax.tree.map(lambda a, i=start, j=stop: a[i:j], caches[group])

        def run(p: Params, h: jax.Array, c: GroupCache | None, g: str = group) -> tuple[jax.Array, GroupCache | None]:
            return forward(g, p, h, c)

        x, new = run_layers(group_params(groups[group], start, stop), x, run, cache)
        if new is not None:
            pieces.setdefault(group, []).append(new)
    if caches is None:
        return x, None
    return x, {group: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) for group, parts in pieces.items()}
