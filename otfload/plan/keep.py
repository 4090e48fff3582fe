"""``quantized="keep"``: plan a quantized leaf as its stored parts, each an ordinary leaf.

A leaf whose HF tensors are all :class:`~otfload.index.quant.QuantizedTensor` is replaced in the
plan by one *part leaf* per stored part (``path[codes]``, ``path[scale]``, ...): its sources are the
stored tensors (one per stacked slice, as for any leaf, so layers and experts stack with one
``np.stack`` per part), its dtype is the stored dtype, and its hooks are the leaf's hooks carried
over to the part (:func:`part_hooks`). The builder then reads, stacks and places each part exactly
like a dense leaf: only the stored bytes a device needs, no decode. The API assembles the placed
parts into an :class:`~otfload.quantized.QuantizedArray`.

Carrying a hook over to a part (a part is a blocked view of the weight, see
:mod:`otfload.index.quant.parts`): a transpose permutes the part and its blocks; a reshape that
splits an axis splits its block from the innermost new axis outwards (it must divide evenly), one
that merges axes needs every axis inside the block's to be whole; a slice must start and stop on
block edges (a strided slice only on unblocked axes). Otherwise the leaf is dequantised on load as
in the default mode, and ``LoadPlan.kept_notes`` says why.

Sharding: the part leaves take the leaf's ``PartitionSpec``, so every device holds the codes of its
box of the weight together with the scales of exactly those blocks. A part axis of one block
(a per-tensor or per-row scale) is replicated along that axis. Where a shard edge would cut
through a block (``dim / mesh size`` not a multiple of the block), that axis is not split for any
part of the leaf — a coarser sharding of this leaf, recorded in :attr:`KeptLeaf.note`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from otfload.errors import InvalidOptionError
from otfload.index.quant.parts import NotKeepable, StoredPart
from otfload.index.quant.tensor import QuantizedTensor
from otfload.plan.abstract import AbstractLeaf
from otfload.plan.hooks import Hook, Reshape, Slice, Transpose, chain_shapes, reshape_groups
from otfload.plan.planner import LeafPlan, LoadPlan
from otfload.quantized import PartLayout, QuantizedArray

QUANTIZED_MODES = ("dequantize", "keep")

Shape = tuple[int, ...]
# A mesh axis entry of a PartitionSpec: one axis name, several, or None (not split).
SpecEntry = str | tuple[str, ...] | None


@dataclass(frozen=True)
class PartState:
    """A part as a blocked view of the weight at some point of the hook chain."""

    logical: Shape
    block: Shape
    pack_axis: int | None = None

    @property
    def part_shape(self) -> Shape:
        return tuple(-(-d // b) for d, b in zip(self.logical, self.block, strict=True))


@dataclass(frozen=True)
class KeptLeaf:
    """A leaf placed packed: which part leaves hold it and how to assemble the QuantizedArray."""

    path: str
    parts: dict[str, str]  # role -> part leaf path
    layouts: tuple[tuple[str, PartLayout], ...]
    shape_tail: Shape
    dtype: str
    storage: str
    spec: PartitionSpec
    note: str = ""

    def assemble(self, arrays: dict[str, Any]) -> QuantizedArray:
        """The QuantizedArray from the placed part arrays (removed from ``arrays``)."""
        placed = {role: arrays.pop(path) for role, path in self.parts.items()}
        return QuantizedArray.from_parts(placed, self.shape_tail, self.dtype, self.layouts, self.storage)


def _transpose(hook: Transpose, state: PartState) -> tuple[Hook, PartState]:
    perm = hook.permutation(len(state.logical))
    pack = None if state.pack_axis is None else perm.index(state.pack_axis)
    return Transpose(perm), PartState(tuple(state.logical[p] for p in perm), tuple(state.block[p] for p in perm), pack)


def _split(b: int, d: int, dims: Shape) -> Shape:
    """The blocks of ``dims`` (a split of an axis ``d`` with block ``b``): filled from the innermost
    axis outwards; only the outermost may end in a partial block (as ``d`` itself may)."""
    if b == d:
        return dims
    out, rest = [], b
    for k, dj in enumerate(reversed(dims)):
        outermost = k == len(dims) - 1
        if rest >= dj and rest % dj == 0 and not outermost:
            out.append(dj)
            rest //= dj
        elif rest >= dj and outermost:
            out.append(dj)
            rest = 1
        elif dj % rest == 0 or outermost:
            out.append(rest)
            rest = 1
        else:
            raise NotKeepable(f"a reshape splits blocks of {b} across axes {dims}")
    if math.prod(out) != b and math.prod(out) != d:
        raise NotKeepable(f"a reshape splits blocks of {b} across axes {dims}")
    return tuple(reversed(out))


def _merge(blocks: Shape, dims: Shape) -> int:
    """The block of one axis merged from ``dims`` with ``blocks``."""
    first = next((i for i, b in enumerate(blocks) if b > 1), None)
    if first is None:
        return 1
    if any(blocks[j] != dims[j] for j in range(first + 1, len(dims))):
        raise NotKeepable(f"a reshape merges axes {dims} whose blocks {blocks} do not tile the merged axis")
    if math.prod(dims[:first]) > 1 and dims[first] % blocks[first]:
        raise NotKeepable(f"a reshape merges axes {dims} with a partial block of {blocks[first]}")
    return blocks[first] * math.prod(dims[first + 1 :])


def _reshape(hook: Reshape, state: PartState) -> tuple[Hook, PartState]:
    out_shape = hook.out_shape(state.logical)
    block: list[int] = [1] * len(out_shape)
    pack = None
    for gi, gj in reshape_groups(state.logical, out_shape):
        blocks = tuple(state.block[i] for i in gi)
        if len(gi) == 1:
            new = _split(blocks[0], state.logical[gi[0]], tuple(out_shape[j] for j in gj))
        elif len(gj) == 1:
            new = (_merge(blocks, tuple(state.logical[i] for i in gi)),)
        elif all(b == 1 for b in blocks):
            new = (1,) * len(gj)
        else:
            raise NotKeepable(f"{hook} regroups blocked axes {gi} into {gj}")
        for j, b in zip(gj, new, strict=True):
            block[j] = b
        if state.pack_axis in gi:
            packed = [j for j, b in zip(gj, new, strict=True) if b > 1]
            if len(packed) != 1 or block[packed[0]] != state.block[state.pack_axis]:
                raise NotKeepable(f"{hook} splits packed words across axes")
            pack = packed[0]
    new_state = PartState(tuple(out_shape), tuple(block), pack)
    return Reshape(new_state.part_shape), new_state


def _slice(hook: Slice, state: PartState) -> tuple[Hook, PartState]:
    axis = hook.axis % len(state.logical)
    d, b = state.logical[axis], state.block[axis]
    kept = hook.positions(d)
    logical = list(state.logical)
    logical[axis] = len(kept)
    block = list(state.block)
    if b == 1:
        part = hook
    elif b >= d:  # one block covers the axis: the part keeps its single element
        block[axis] = max(1, len(kept))
        part = Slice(axis, 0, 1)
    elif kept.step == 1 and kept.start % b == 0 and (kept.stop % b == 0 or kept.stop == d):
        part = Slice(axis, kept.start // b, -(-kept.stop // b))
        block[axis] = min(b, max(1, len(kept)))
    else:
        raise NotKeepable(f"{hook} cuts through blocks of {b}")
    if axis == state.pack_axis and block[axis] != b:
        raise NotKeepable(f"{hook} cuts through packed words")
    return part, PartState(tuple(logical), tuple(block), state.pack_axis)


def part_hooks(part: StoredPart, plan: LeafPlan, logical: Shape) -> tuple[tuple[Hook, ...], PartState]:
    """The hooks that take the stored ``part`` of an HF tensor of ``logical`` shape to its part leaf
    slice, and the part's final blocked view; :class:`NotKeepable` when a hook cannot be carried."""
    hooks: list[Hook] = []
    if part.view is not None:
        hooks.append(Reshape(part.view))
    if part.perm is not None:
        hooks.append(Transpose(part.perm))
    state = PartState(logical, part.block, part.pack_axis)
    for hook, shape in zip(plan.hooks, plan.shapes, strict=False):
        state = dataclasses.replace(state, logical=shape)
        if isinstance(hook, Transpose):
            step, state = _transpose(hook, state)
        elif isinstance(hook, Reshape):
            step, state = _reshape(hook, state)
        elif isinstance(hook, Slice):
            step, state = _slice(hook, state)
        else:
            raise NotKeepable(f"{hook} cannot be applied to packed parts")
        hooks.append(step)
    return tuple(hooks), state


def _mesh_size(mesh: Mesh | AbstractMesh, entry: SpecEntry) -> int:
    names = (entry,) if isinstance(entry, str) else tuple(entry or ())
    return math.prod(mesh.shape[a] for a in names)


def kept_spec(
    leaf: AbstractLeaf, n_stack: int, states: dict[str, PartState]
) -> tuple[PartitionSpec, dict[str, PartitionSpec], str]:
    """The leaf's spec with axes that would cut a block unsplit, per-part specs, and the note."""
    sharding = leaf.sharding
    if not isinstance(sharding, NamedSharding):
        raise NotKeepable(f"its sharding {type(sharding).__name__} is not a NamedSharding")
    spec: list[SpecEntry] = list(sharding.spec) + [None] * (len(leaf.shape) - len(sharding.spec))
    notes = []
    for k, d in enumerate(leaf.shape[n_stack:]):
        axis, entry = n_stack + k, spec[n_stack + k]
        if entry is None:
            continue
        size = _mesh_size(sharding.mesh, entry)
        for role, s in states.items():
            b = s.block[k]
            if b > 1 and s.part_shape[k] > 1 and (d % size or (d // size) % b):
                notes.append(f"axis {axis} ({d}) not split over {entry!r}: {role} blocks of {b} "
                             f"do not divide its shards of {d / size:g}")
                spec[axis] = None
                break
    part_specs = {}
    for role, s in states.items():
        ps = list(spec)
        for k, n in enumerate(s.part_shape):
            if n == 1:
                ps[n_stack + k] = None
        part_specs[role] = PartitionSpec(*ps)  # type: ignore[no-untyped-call]  # jax: unannotated __init__
    return PartitionSpec(*spec), part_specs, "; ".join(notes)  # type: ignore[no-untyped-call]  # as above


def _layout(part: StoredPart) -> tuple[object, ...]:
    """Everything about a part but the stored tensor it reads: equal for slices stored alike."""
    return tuple(getattr(part, f.name) for f in dataclasses.fields(part) if f.name != "info")


def keep_leaf(plan: LeafPlan) -> tuple[KeptLeaf, dict[str, LeafPlan]]:
    """The part leaves of a leaf whose sources are all quantized; :class:`NotKeepable` otherwise."""
    sources = [s for s in plan.sources if isinstance(s, QuantizedTensor)]
    if not sources or len(sources) != len(plan.sources):
        raise NotKeepable("its tensors are not all quantized")
    per_slice = [s.stored_parts() for s in sources]
    first = per_slice[0]
    layout_of = {role: _layout(p) for role, p in first.items()}
    for parts in per_slice[1:]:
        if {r: _layout(p) for r, p in parts.items()} != layout_of or \
                any(parts[r].info.shape != first[r].info.shape for r in parts):
            raise NotKeepable("its slices (layers / experts) are stored in different layouts")
    if plan.layout is not None:
        raise NotKeepable("its stack axes lie inside the leaf (stack_at): packed parts are stacked leading")
    n_stack = len(plan.stack_axes)
    hooks, states = {}, {}
    for role, part in first.items():
        hooks[role], states[role] = part_hooks(part, plan, sources[0].shape)
        if states[role].logical != plan.slice_shape:  # pragma: no cover - the hooks' shapes are checked
            raise NotKeepable(f"{role} ends as {states[role].logical}, not {plan.slice_shape}")
    spec, part_specs, note = kept_spec(plan.leaf, n_stack, states)
    sharding = plan.leaf.sharding
    assert isinstance(sharding, NamedSharding)  # kept_spec refuses any other
    leaves, paths, layouts = {}, {}, []
    for role, part in first.items():
        state = states[role]
        path = f"{plan.path}[{role}]"
        infos = tuple(parts[role].info for parts in per_slice)
        shapes = tuple(chain_shapes(hooks[role], part.info.shape))
        if shapes[-1] != state.part_shape:  # pragma: no cover - part_hooks keeps them in step
            raise NotKeepable(f"{role} part shape {shapes[-1]} is not {state.part_shape}")
        leaf = AbstractLeaf(path, (*plan.stack_shape, *state.part_shape), part.info.dtype,
                            NamedSharding(sharding.mesh, part_specs[role]))
        leaves[path] = LeafPlan(leaf, plan.rule, plan.stack_axes, infos, hooks[role], shapes,
                                stack_values=plan.stack_values)
        paths[role] = path
        layouts.append((role, PartLayout.of_part(part, state.block, state.pack_axis)))
    kept = KeptLeaf(plan.path, paths, tuple(layouts), plan.slice_shape, str(plan.leaf.dtype.name),
                    sources[0].storage, spec, note)
    return kept, leaves


def keep_quantized(plan: LoadPlan, *, layers_only: bool = False) -> LoadPlan:
    """``plan`` with every quantized leaf replaced by its part leaves; with ``layers_only`` (a bundled
    model, which materializes only its layer stack's weights in the layer loop: the embedding and
    ``lm_head`` are used directly) only the leaves :attr:`LeafPlan.in_layer_stack`.

    A quantized leaf that cannot be kept (or is outside the layer stack) stays dequantised on load;
    the plan's ``kept_notes`` say why.
    """
    leaves: dict[str, LeafPlan] = {}
    kept: dict[str, KeptLeaf] = {}
    notes: dict[str, str] = {}
    for path, leaf_plan in plan.leaves.items():
        if not any(isinstance(s, QuantizedTensor) for s in leaf_plan.sources):
            leaves[path] = leaf_plan
            continue
        if layers_only and not leaf_plan.in_layer_stack:
            notes[path] = "dequantised: used outside the layer loop"
            leaves[path] = leaf_plan
            continue
        try:
            kept[path], parts = keep_leaf(leaf_plan)
        except NotKeepable as e:
            notes[path] = f"dequantised: {e}"
            leaves[path] = leaf_plan
            continue
        leaves.update(parts)
        if kept[path].note:
            notes[path] = kept[path].note
    return dataclasses.replace(plan, leaves=leaves, kept=kept, kept_notes=notes)


def check_quantized_mode(quantized: object) -> str:
    """``quantized`` if it is a mode otfload knows; :class:`InvalidOptionError` otherwise."""
    if not isinstance(quantized, str) or quantized not in QUANTIZED_MODES:
        raise InvalidOptionError(f"quantized={quantized!r}: expected one of {', '.join(map(repr, QUANTIZED_MODES))}")
    return quantized


def assemble_kept(plan: LoadPlan, arrays: Mapping[str, jax.Array]) -> dict[str, Any]:
    """``arrays`` (placed leaves by path) with each kept leaf's parts assembled under its path.

    The values are leaf values: ``jax.Array``, and a :class:`QuantizedArray` for each kept leaf.
    """
    out: dict[str, Any] = dict(arrays)
    for path, kept in plan.kept.items():
        out[path] = kept.assemble(out)
    return out
