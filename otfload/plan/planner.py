"""The load plan: for every target leaf, the HF tensors it is built from and how — computed from
headers alone, before any tensor byte is read, so it can be printed and checked.

For each leaf the first matching :class:`~otfload.plan.mapping.Rule` gives an HF key template;
its stack axes (scanned layers, experts) enumerate one HF key per slice of the leaf, in row-major
order over the leading stack dimensions. Every key is checked to exist (or a fallback, for tied
weights) and every tensor's shape is carried through the hooks and compared with the leaf's slice
shape. All problems — missing, mis-shaped and (with ``strict``) unexpected tensors — are collected
and raised together as one :class:`~otfload.errors.CheckpointMismatchError`. A tensor whose values
the leaf cannot hold faithfully (integers or booleans into floats, FP8 codes without their scales)
is an :class:`~otfload.errors.UnfaithfulCastError` unless its rule says ``cast=True``. Quantized
weights (and weights with LoRA adapters merged in) arrive from the index already as a
:class:`~otfload.index.derived.DerivedTensor` (float32 values decoded on read), so they plan like
any float tensor.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from jax.sharding import Sharding

from otfload.errors import MappingError, TensorProblem, UnfaithfulCastError, mismatch_error
from otfload.gcpause import gc_paused
from otfload.index.checkpoint import CheckpointIndex
from otfload.index.concat import ConcatenatedTensor, head_blocks
from otfload.index.derived import DerivedTensor, is_derived
from otfload.index.header import TensorInfo
from otfload.plan import leaf_bytes
from otfload.plan.abstract import AbstractLeaf
from otfload.plan.boxes import Box
from otfload.plan.hooks import Hook, Shape, chain_shapes
from otfload.plan.mapping import MappingTable, Rule, format_key, hf_values, placeholders, slice_values, stack_dims
from otfload.plan.sharding import transposed_sharding

# The placeholder through which a mapping table reads HF layer ``i`` (``model.layers.{layer}.…``).
LAYER = "layer"


@dataclass(frozen=True)
class LeafPlan:
    """How one target leaf is built: ``sources`` (row-major over the stack dims) through ``hooks``.

    ``leaf`` has its stack dims leading, as every box of the plan does. When the tree wants them
    elsewhere (a rule's ``stack_at``), ``target`` is the leaf as the tree has it and ``layout`` the
    order of ``leaf``'s dims that gives it (target dim ``i`` is ``leaf`` dim ``layout[i]``): the
    builder writes each device's buffer in the target's layout, through a view in ``leaf``'s."""

    leaf: AbstractLeaf
    rule: Rule
    stack_axes: tuple[str, ...]
    sources: tuple[TensorInfo | DerivedTensor, ...]
    hooks: tuple[Hook, ...]
    shapes: tuple[Shape, ...]  # the source shape, then the output shape of each hook
    layout: tuple[int, ...] | None = None
    target: AbstractLeaf | None = None
    # per stack axis, the HF value of each of its positions (the layers a group holds)
    stack_values: tuple[tuple[int | str, ...], ...] = ()

    @property
    def placed(self) -> AbstractLeaf:
        """The leaf as the target tree has it (its shape, sharding and dims' order)."""
        return self.leaf if self.target is None else self.target

    @property
    def path(self) -> str:
        return self.leaf.path

    @property
    def in_layer_stack(self) -> bool:
        """Whether the leaf is read per HF layer (its rule's ``{layer}``: a stack axis of a scanned
        group, or one layer of an unscanned tree) — what a model runs in its layer loop, unlike the
        embedding or ``lm_head`` — whatever the target names its leaves."""
        return LAYER in placeholders(self.rule.source)

    @property
    def stack_shape(self) -> tuple[int, ...]:
        return self.leaf.shape[: len(self.stack_axes)]

    @property
    def slice_shape(self) -> tuple[int, ...]:
        return self.leaf.shape[len(self.stack_axes) :]

    @functools.cached_property
    def source_bytes(self) -> int:
        with gc_paused():  # the first count lists each quantized tensor's parts, which live on
            return sum(info.nbytes for info in self.sources)

    @property
    def storage(self) -> str:
        """How the leaf's HF tensors are stored: their dtype, or the derived layout (quantized, adapted)."""
        if not self.sources:
            return ""
        first = self.sources[0]
        return str(first.dtype) if isinstance(first, TensorInfo) else first.storage

    def device_boxes(self, devices: leaf_bytes.Devices | None = None, sharding: Sharding | None = None) -> list[Box]:
        """The distinct boxes of the leaf on ``devices`` (default: this process's) under ``sharding``
        (default: its own; a read layout chosen for it)."""
        return leaf_bytes.device_boxes(self.leaf, sharding, devices)

    def process_bytes(self, devices: leaf_bytes.Devices | None = None) -> int:
        """Stored source bytes the shards of ``devices`` (default: this process's) need, each HF tensor
        once, every part of quantized or adapted tensors included — without pages or gaps."""
        with gc_paused():  # the boxes and selections counted are cached by leaf_bytes, or acyclic
            return leaf_bytes.leaf_needed(self, self.device_boxes(devices))

    def ideal_bytes(self, devices: leaf_bytes.Devices | None = None) -> int:
        """Source bytes of the elements ``devices`` hold, each distinct shard once: no reader goes below."""
        with gc_paused():  # as process_bytes
            return leaf_bytes.leaf_ideal(self, devices)

    def shard_bytes(self) -> int:
        """Bytes of the leaf's largest device shard in its target dtype (what one device holds)."""
        return leaf_bytes.shard_bytes(self.leaf)

    @property
    def stack_dims(self) -> tuple[int, ...]:
        """The target leaf's dimension of each stack axis."""
        if self.layout is None:
            return tuple(range(len(self.stack_axes)))
        return tuple(self.layout.index(k) for k in range(len(self.stack_axes)))

    def describe(self) -> dict[str, Any]:
        """A JSON-able summary (what ``otfload inspect`` prints)."""
        keys = [s.name for s in self.sources]
        placed = self.placed
        return {
            "leaf": self.path,
            "shape": list(placed.shape),
            "dtype": str(placed.dtype),
            "sharding": str(getattr(placed.sharding, "spec", placed.sharding)),
            "stack_axes": list(self.stack_axes),
            "stack_dims": list(self.stack_dims),
            "stack_values": {a: list(v) for a, v in zip(self.stack_axes, self.stack_values, strict=False)},
            "hf_keys": keys if len(keys) <= 2 else [keys[0], f"... {len(keys) - 2} more ...", keys[-1]],
            "num_hf_keys": len(keys),
            "hf_dtype": str(self.sources[0].dtype) if self.sources else None,
            "storage": self.storage,
            "hooks": [repr(h) for h in self.hooks],
            "source_bytes": self.source_bytes,
        }


# What a leaf's reads depend on (see leaf_signature): shape, dtype, spec, hooks, shapes, sources'
# count, storage and the first source's shape.
LeafSignature = tuple[
    tuple[int, ...], str, str, tuple[Hook, ...], tuple[Shape, ...], int, str, tuple[int, ...] | None
]


def leaf_signature(plan: LeafPlan) -> LeafSignature:
    """What a leaf's reads depend on but the tensors' names and offsets: leaves with equal
    signatures (the layers of an unscanned model) read alike."""
    leaf = plan.leaf
    first = plan.sources[0] if plan.sources else None
    return (leaf.shape, str(leaf.dtype), str(getattr(leaf.sharding, "spec", leaf.sharding)), plan.hooks,
            plan.shapes, len(plan.sources), plan.storage, getattr(first, "shape", None))


@dataclass
class LoadPlan:
    """Every leaf's plan plus the checkpoint tensors that no leaf uses."""

    leaves: dict[str, LeafPlan]
    unused: list[str] = field(default_factory=list)
    activation: dict[str, TensorInfo] = field(default_factory=dict)  # activation-side quantization scales
    # quantized="keep" (otfload.plan.keep): leaves placed packed, and why others were not / how sharded
    kept: dict[str, Any] = field(default_factory=dict)
    kept_notes: dict[str, str] = field(default_factory=dict)
    # What the plan was made for, when a family's model: its name and the checkpoint's config.json.
    family: str = ""
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def source_bytes(self) -> int:
        """Checkpoint bytes the plan uses, each tensor once (DeepSeek's ``kv_b_proj`` feeds two leaves)."""
        with gc_paused():  # as LeafPlan.source_bytes
            unique = {(info.file, info.name): info.nbytes for p in self.leaves.values() for info in p.sources}
            return sum(unique.values())


def _lookup(
    index: CheckpointIndex, rule: Rule, values: dict[str, int | str], config: Mapping[str, Any]
) -> tuple[str, TensorInfo | DerivedTensor | None]:
    key = format_key(rule.source, values)
    if rule.join is not None:  # the HF tensors joined (the first one absent named)
        sources = rule.join.sources(values, config)
        absent = [name for name, _ in sources if name not in index]
        if absent:
            return absent[0], None
        # a quantized (or adapted) part is decoded as it is read, before the join
        return key, head_blocks(key, [(index[name], sizes) for name, sizes in sources], rule.join.head_count(config))
    for candidate in (key, *(format_key(f, values) for f in rule.fallbacks)):
        if candidate in index:
            return candidate, index[candidate]
    return key, None


def _stacked_first(
    leaf: AbstractLeaf, dims: tuple[int, ...]
) -> tuple[AbstractLeaf, tuple[int, ...] | None]:
    """``leaf`` with the stack dims ``dims`` moved to the front, and the order that restores it
    (None when they already lead)."""
    if dims == tuple(range(len(dims))):
        return leaf, None
    order = (*dims, *(d for d in range(len(leaf.shape)) if d not in dims))
    axes = None if leaf.logical_axes is None else tuple(leaf.logical_axes[d] for d in order)
    first = AbstractLeaf(leaf.path, tuple(leaf.shape[d] for d in order), leaf.dtype,
                         transposed_sharding(leaf.sharding, order), axes)
    return first, tuple(order.index(d) for d in range(len(order)))


def _unfit_stack_axis(
    leaf: AbstractLeaf, rule: Rule, fixed: dict[str, int], stack_axes: tuple[str, ...], dims: tuple[int, ...],
    stack_shape: tuple[int, ...], index: CheckpointIndex, config: Mapping[str, Any],
) -> TensorProblem | None:
    """A problem naming the first stack axis placed by ``stack_at`` whose last entry has no HF tensor
    while its first has (the dimension the table puts it at is another one in this tree, or the
    checkpoint has fewer), with the count the checkpoint has; None when every such axis fits."""
    for k, (name, size) in enumerate(zip(stack_axes, stack_shape, strict=True)):
        def present(i: int, k: int = k) -> bool:
            position = [0] * len(stack_axes)
            position[k] = i
            try:
                values = hf_values(rule, fixed, stack_axes, position, config)
            except MappingError:  # past the end of the rule's indices
                return False
            return _lookup(index, rule, values, config)[1] is not None

        if name not in rule.stack_at or size == 0 or not present(0) or present(size - 1):
            continue
        have = 1
        while have < size and present(have):
            have += 1
        where = f"dimension {dims[k]}" + (f" ({rule.stack_at[name]!r})" if name in rule.stack_at else "")
        return TensorProblem("shape", rule.source, leaf.path,
                             f"stack axis {name!r} at {where} with {size} entries (leaf shape {leaf.shape})",
                             f"{have} {name} tensors in the checkpoint")
    return None


def plan_leaf(
    leaf: AbstractLeaf,
    table: MappingTable,
    index: CheckpointIndex,
    config: Mapping[str, Any],
    problems: list[TensorProblem],
) -> LeafPlan | None:
    """Plan one leaf, appending any problems found; returns None when it cannot be built."""
    found = table.find(leaf.path)
    if found is None:
        problems.append(TensorProblem("missing", None, leaf.path, expected=f"a mapping rule for {leaf.shape}"))
        return None
    rule, fixed, stack_axes = found
    if len(leaf.shape) < len(stack_axes):
        problems.append(TensorProblem("shape", rule.source, leaf.path, f"{len(stack_axes)} stack dims", leaf.shape))
        return None
    dims = stack_dims(rule, stack_axes, len(leaf.shape), config)
    target, (leaf, layout) = leaf, _stacked_first(leaf, dims)
    hooks = tuple(h.resolve(config) for h in rule.hooks)
    stack_shape, slice_shape = leaf.shape[: len(stack_axes)], leaf.shape[len(stack_axes) :]
    unfit = _unfit_stack_axis(target, rule, fixed, stack_axes, dims, stack_shape, index, config)
    if unfit is not None:
        problems.append(unfit)
        return None
    sources, shapes, ok = [], None, True
    along: list[dict[int, int | str]] = [{} for _ in stack_axes]
    for combo, values in slice_values(rule, fixed, stack_axes, stack_shape, config):
        for k, name in enumerate(stack_axes):
            along[k].setdefault(combo[k], values[name])
        key, info = _lookup(index, rule, values, config)
        if info is None:
            problems.append(TensorProblem("missing", key, leaf.path, expected=slice_shape))
            ok = False
            continue
        try:
            chain = tuple(chain_shapes(hooks, info.shape))
        except MappingError:
            chain = None
        if chain is None or chain[-1] != slice_shape or (shapes is not None and chain != shapes):
            actual = info.shape if chain is None else f"{info.shape} (becomes {chain[-1]} after hooks)"
            problems.append(TensorProblem("shape", key, leaf.path, slice_shape, actual, info.file))
            ok = False
            continue
        shapes = chain
        sources.append(info)
    if not ok or math.prod(stack_shape) != len(sources):
        return None
    return LeafPlan(leaf, rule, stack_axes, tuple(sources), hooks, shapes or (slice_shape,), layout,
                    None if layout is None else target, tuple(tuple(a.values()) for a in along))


def unfaithful_cast(plan: LeafPlan) -> str | None:
    """Why ``plan``'s tensors cannot become its leaf's dtype faithfully, or None when they can."""
    target = np.dtype(plan.leaf.dtype)
    if plan.rule.cast or not plan.sources or target.kind not in "fcV":
        return None
    for info in plan.sources:
        if is_derived(info):
            continue
        if info.dtype.kind in "iub":
            return f"{info.dtype} values of {info.name!r} into {target} leaf {plan.path!r}"
        if "float8" in info.dtype.name:
            return f"{info.dtype} codes of {info.name!r} without scales into {target} leaf {plan.path!r}"
    return None


def build_plan(
    index: CheckpointIndex,
    leaves: Mapping[str, AbstractLeaf],
    table: MappingTable,
    config: Mapping[str, Any] | None = None,
    *,
    strict: bool = False,
) -> LoadPlan:
    """Plan every leaf; raise one error listing every problem, or return the plan."""
    config = config or {}
    problems: list[TensorProblem] = []
    plans = {}
    with gc_paused():  # every record made here lives as long as the plan
        for path, leaf in leaves.items():
            plan = plan_leaf(leaf, table, index, config, problems)
            if plan is not None:
                plans[path] = plan
    casts = [why for plan in plans.values() if (why := unfaithful_cast(plan))]
    if casts:
        raise UnfaithfulCastError(
            f"{len(casts)} tensor(s) cannot be held faithfully by their leaves (set cast=True on the rule "
            "if the cast is meant): " + "; ".join(casts[:10])
        )
    used = {info.name for plan in plans.values() for info in plan.sources}
    used |= {p.info.name for plan in plans.values() for info in plan.sources
             if isinstance(info, ConcatenatedTensor) for p in info.pieces}
    used |= {p.hf_key for p in problems if p.hf_key}
    unused = sorted(k for k in index.tensors if k not in used and not table.ignored(k))
    if strict:
        problems += [
            TensorProblem("unexpected", k, None, actual=index[k].shape, file=index[k].file) for k in unused
        ]
    if problems:
        raise mismatch_error(problems)
    return LoadPlan(plans, unused, dict(index.activation))
