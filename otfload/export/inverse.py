"""The mapping table run backwards: which HF tensor every slice of every leaf becomes, and how.

For each leaf the first matching rule gives the HF key template; every position on the leaf's
stack axes (scanned layers, experts) is one HF key. The rule's hooks are undone in reverse order
with :meth:`~otfload.plan.hooks.Hook.inverse`. A :class:`~otfload.plan.hooks.Slice` has no
inverse on its own: the leaves that slice the same HF tensor (GPT-OSS gate/up interleave, a
split ``kv_b``) form a group, each part is written into its positions of one buffer, and the
hooks before the slice are then undone on the assembled tensor.

HF shapes come from a reference checkpoint when one is given (exact); otherwise they are inferred
backwards through the hooks (see :func:`otfload.export.shapes.infer_in_shape`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from otfload.errors import MappingError
from otfload.export.gather import Position
from otfload.export.shapes import infer_in_shape, slice_positions
from otfload.index.concat import head_runs
from otfload.plan.hooks import Hook, Shape, Slice, chain_shapes, run_forward
from otfload.plan.mapping import Join, MappingTable, Rule, format_key, slice_values, stack_dims

Fetch = Callable[[str, Position], np.ndarray]


@dataclass(frozen=True)
class Part:
    """One slice of one leaf (``index`` on its stack axes) and the inverse hooks that turn it into
    (its share of) an HF tensor; ``slice`` places it when several leaves share that tensor."""

    leaf: str
    index: Position
    undo: tuple[Hook, ...]
    slice: Slice | None = None


@dataclass(frozen=True)
class HFTensor:
    """One HF tensor to write: its parts, assembled into ``assembled_shape``, then ``undo`` applied."""

    key: str
    shape: Shape
    parts: tuple[Part, ...]
    assembled_shape: Shape
    undo: tuple[Hook, ...] = ()
    # a part of a joined source (``Rule.join``): its rows of the joined tensor, in order
    rows: tuple[tuple[int, int], ...] = ()

    @property
    def sources(self) -> tuple[tuple[str, Position], ...]:
        """The ``(leaf, index)`` slices :meth:`materialize` fetches, in the order it fetches them."""
        return tuple((p.leaf, p.index) for p in self.parts)

    def materialize(self, fetch: Fetch) -> np.ndarray:
        """Build the tensor from ``fetch(leaf, index)`` (a host copy of one leaf slice), called once
        for each of :attr:`sources` in turn."""
        first = self.parts[0]
        if first.slice is None:
            x = run_forward(first.undo, fetch(first.leaf, first.index))
        else:
            assembled: np.ndarray | None = None
            for part in self.parts:
                piece = run_forward(part.undo, fetch(part.leaf, part.index))
                if assembled is None:
                    assembled = np.empty(self.assembled_shape, piece.dtype)
                cut = part.slice
                assert cut is not None  # every part of a sliced tensor has its slice (_tensor)
                where = [slice(None)] * assembled.ndim
                where[cut.axis] = slice(cut.start, cut.stop, cut.step)
                assembled[tuple(where)] = piece
            assert assembled is not None  # a sliced tensor has parts
            x = assembled
        x = run_forward(self.undo, x)
        if self.rows:
            x = np.concatenate([x[a:b] for a, b in self.rows])
        if tuple(x.shape) != self.shape:
            raise MappingError(f"{self.key}: inverse hooks produced shape {x.shape}, expected {self.shape}")
        return x


@dataclass(frozen=True)
class _Entry:
    """One leaf slice and the HF key it becomes, before shapes are known."""

    key: str
    leaf: str
    index: Position
    values: dict[str, int | str]  # placeholder values on the HF side
    rule: Rule
    hooks: tuple[Hook, ...]  # resolved against the config
    cut: int | None  # position of the Slice hook, if any
    out_shape: Shape  # the leaf slice shape (the forward chain's output)

    @property
    def cut_at(self) -> int:
        """:attr:`cut`, for an entry that slices (in a group of several leaves)."""
        if self.cut is None:
            raise MappingError(f"{self.key}: leaf {self.leaf!r} shares the HF tensor but does not slice it")
        return self.cut

    @property
    def cut_hook(self) -> Slice:
        """The :class:`Slice` at :attr:`cut_at`."""
        hook = self.hooks[self.cut_at]
        assert isinstance(hook, Slice)  # cut is where the Slice is (_entries)
        return hook


def _entries(leaves: Mapping[str, Shape], table: MappingTable, config: Mapping[str, Any]) -> list[_Entry]:
    entries, unmapped = [], []
    for path, shape in leaves.items():
        found = table.find(path)
        if found is None or len(shape) < len(found[2]):
            unmapped.append(path)
            continue
        rule, fixed, stack_axes = found
        hooks = tuple(h.resolve(config) for h in rule.hooks)
        cuts = [i for i, h in enumerate(hooks) if isinstance(h, Slice)]
        if len(cuts) > 1:
            raise MappingError(f"rule {rule.target!r} slices more than once; it cannot be inverted")
        dims = stack_dims(rule, stack_axes, len(shape), config)
        stack_shape = tuple(shape[d] for d in dims)
        out_shape = tuple(n for d, n in enumerate(shape) if d not in dims)
        for combo, values in slice_values(rule, fixed, stack_axes, stack_shape, config):
            key = format_key(rule.source, values)
            entries.append(_Entry(key, path, _position(combo, dims), values, rule, hooks, cuts[0] if cuts else None,
                                  out_shape))
    if unmapped:
        raise MappingError(f"no mapping rule for leaves {unmapped}; they cannot be exported")
    return entries


def _position(combo: tuple[int, ...], dims: tuple[int, ...]) -> Position:
    """The leaf position of stack slice ``combo`` whose axes lie on ``dims``: ``(i, j)`` when they
    lead, ``(None, i)`` for one axis on the second dim."""
    if dims == tuple(range(len(dims))):
        return combo
    index: list[int | None] = [None] * (max(dims) + 1)
    for d, i in zip(dims, combo, strict=True):
        index[d] = i
    return tuple(index)


def _drop_tied(entries: list[_Entry], tied: bool) -> list[_Entry]:
    """With tied embeddings transformers writes no tensor for a weight tied to another one: drop
    entries whose rule falls back to a key that another entry writes."""
    if not tied:
        return entries
    written = {e.key for e in entries}
    return [e for e in entries if not any(format_key(f, e.values) in written for f in e.rule.fallbacks)]


def _back(entry: _Entry, shape: Shape, start: int, stop: int) -> Shape:
    """Infer the input shape of hooks ``stop .. start-1`` of ``entry`` from the output shape."""
    for i in reversed(range(stop, start)):
        shape = infer_in_shape(entry.hooks[i], shape, entry.key)
    return shape


def _infer_hf_shape(group: list[_Entry]) -> Shape:
    first = group[0]
    if first.cut is None:
        return _back(first, first.out_shape, len(first.hooks), 0)
    pieces = [_back(e, e.out_shape, len(e.hooks), e.cut_at + 1) for e in group]
    axis = first.cut_hook.axis % len(pieces[0])
    assembled = list(pieces[0])
    assembled[axis] = sum(p[axis] for p in pieces)
    return _back(first, tuple(assembled), first.cut, 0)


def _check_group(group: list[_Entry]) -> None:
    if len(group) == 1:
        return
    first = group[0]
    leaves = sorted({e.leaf for e in group})
    if any(e.cut is None for e in group):
        raise MappingError(f"HF key {first.key!r} is produced by leaves {leaves} that do not slice it; "
                           "the table cannot be inverted")
    if any(e.hooks[: e.cut] != first.hooks[: first.cut] for e in group):
        raise MappingError(f"leaves {leaves} slice {first.key!r} after different hooks; cannot invert")


def _undo(entry: _Entry, shapes: list[Shape], start: int, stop: int) -> tuple[Hook, ...]:
    return tuple(entry.hooks[i].inverse(shapes[i]) for i in reversed(range(stop, start)))


def _tensor(group: list[_Entry], hf_shape: Shape) -> HFTensor:
    """The inverse plan of one HF tensor, checking every leaf slice fits ``hf_shape``."""
    first, parts = group[0], []
    for e in group:
        try:
            shapes = chain_shapes(e.hooks, hf_shape)
        except MappingError:
            shapes = None
        if shapes is None or shapes[-1] != e.out_shape:
            got = hf_shape if shapes is None else f"{hf_shape}, which becomes {shapes[-1]}"
            raise MappingError(f"leaf {e.leaf!r} slice {e.out_shape} does not fit HF tensor {e.key!r} ({got})")
        if e.cut is None:
            return HFTensor(e.key, hf_shape, (Part(e.leaf, e.index, _undo(e, shapes, len(e.hooks), 0)),), hf_shape)
        parts.append(Part(e.leaf, e.index, _undo(e, shapes, len(e.hooks), e.cut + 1), e.cut_hook))
    shapes = chain_shapes(first.hooks, hf_shape)
    assembled = shapes[first.cut_at]
    cuts = [e.cut_hook for e in group]
    axes = {cut.axis % len(assembled) for cut in cuts}
    covered = sorted(i for cut in cuts for i in slice_positions(cut, assembled))
    if len(axes) != 1 or covered != list(range(assembled[axes.pop()])):
        raise MappingError(f"the slices of {first.key!r} by {sorted({e.leaf for e in group})} do not cover "
                           "every position exactly once; cannot invert")
    return HFTensor(first.key, hf_shape, tuple(parts), assembled, _undo(first, shapes, first.cut_at, 0))


@dataclass(frozen=True)
class ExportPlan:
    """Every HF tensor to write, in the order of the leaves and stack positions they come from."""

    tensors: dict[str, HFTensor]

    @property
    def shapes(self) -> dict[str, Shape]:
        return {k: t.shape for k, t in self.tensors.items()}


def plan_export(
    leaves: Mapping[str, Shape],
    table: MappingTable,
    config: Mapping[str, Any],
    hf_shapes: Mapping[str, Shape] | None = None,
    *,
    tied: bool = False,
) -> ExportPlan:
    """Invert ``table`` for leaves of the given shapes (``config`` resolves hook and offset names).

    ``hf_shapes`` (from the checkpoint the model was loaded from) gives exact HF shapes; without
    it they are inferred. ``tied`` (the HF config's ``tie_word_embeddings``) drops leaves whose rule
    falls back to a key another leaf writes, as ``save_pretrained`` does. Raises
    :class:`MappingError` for leaves no rule maps, HF keys written by several leaves that do not
    slice them, and slices that do not tile their tensor.
    """
    groups: dict[str, list[_Entry]] = {}
    for entry in _drop_tied(_entries(leaves, table, config), tied):
        groups.setdefault(entry.key, []).append(entry)
    tensors = {}
    for key, group in groups.items():
        _check_group(group)
        shape = tuple(hf_shapes[key]) if hf_shapes is not None and key in hf_shapes else _infer_hf_shape(group)
        join = group[0].rule.join
        if join is None:
            tensors[key] = _tensor(group, shape)
            continue
        joined = _tensor(group, shape)
        for name, part in _split(join, group[0].values, config, joined).items():
            if hf_shapes is not None and name in hf_shapes and tuple(hf_shapes[name]) != part.shape:
                raise MappingError(f"{name}: {part.shape} from leaf {group[0].leaf!r}, the reference has "
                                   f"{tuple(hf_shapes[name])}")
            tensors[name] = part
    return ExportPlan(tensors)


def _split(join: Join, values: Mapping[str, int | str], config: Mapping[str, Any],
           joined: HFTensor) -> dict[str, HFTensor]:
    """The HF tensors a joined one is made of, each its rows of ``joined`` (:func:`head_runs`)."""
    sources = join.sources(values, config)
    runs = head_runs([sizes for _, sizes in sources], join.head_count(config), joined.key)
    out = {}
    at = 0
    rows: list[list[tuple[int, int, int]]] = [[] for _ in sources]  # (stored start, joined start, stop)
    for s, a, b in runs:
        rows[s].append((a, at, at + b - a))
        at += b - a
    for (name, sizes), own in zip(sources, rows, strict=True):
        out[name] = dataclasses.replace(joined, key=name, shape=(sum(sizes), *joined.shape[1:]),
                                        rows=tuple((lo, hi) for _, lo, hi in sorted(own)))
    return out
