"""Reshape hooks: the reusable steps that turn an HF tensor into (one slice of) a target leaf.

A hook is a small frozen dataclass. Besides transforming a whole tensor (:meth:`Hook.forward`),
each hook can carry a *box* through itself, which is what lets a device read only the bytes its
shard needs:

* :meth:`Hook.needed` — given the box of the output a shard needs, the box of the input that
  covers it (a hook that cannot tell asks for the whole input);
* :meth:`Hook.apply` — transform the part of the input that was read (a box of it) and say which
  box of the output the result holds (a superset of what was asked; the builder crops);
* :meth:`Hook.selection` — the exact elements of the input that a selection of the output needs,
  inside the box :meth:`Hook.needed` gives: a head-interleaved reshape (DeepSeek ``kv_b_proj``) or
  a strided slice (GPT-OSS ``gate_up_proj``) needs a box with holes, which the reader skips.

Hooks may name config fields or expressions over them instead of numbers
(``Reshape(("num_attention_heads", -1))``, ``Scale("1 / sqrt(head_dim)")``, see
:mod:`otfload.plan.expressions`); :meth:`Hook.resolve` substitutes them once per load.
:meth:`Hook.inverse` gives the hook that undoes this one, so export runs the same mapping table
backwards, and :meth:`Hook.in_shape` answers which input shape gives an output shape
(:meth:`Hook.out_shape` backwards), so an export without a reference checkpoint knows the HF tensor
shapes.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from otfload.errors import MappingError
from otfload.plan.boxes import (
    Box,
    Selection,
    box_selection,
    cover_range,
    flat_range,
    full_box,
    is_full,
    merge_intervals,
    selection_bounds,
)
from otfload.plan.expressions import evaluate, integer

Shape = tuple[int, ...]
# A reshape carries at most this many flat intervals exactly; beyond, it selects its whole box
# (a selection is for a few hundred heads or rows, not for per-element patterns).
MAX_RESHAPE_INTERVALS = 1 << 16


def _config_int(config: Mapping[str, Any], value: int | str) -> int:
    """A hook argument written as a config field or expression (:mod:`otfload.plan.expressions`)."""
    return integer(value, config, "hook argument")


@dataclass(frozen=True)
class Hook:
    """Base class: a whole-tensor transform; subclasses override the box methods when they can."""

    def resolve(self, config: Mapping[str, Any]) -> Hook:
        """This hook with config field names replaced by their values."""
        return self

    def out_shape(self, in_shape: Shape) -> Shape:
        raise NotImplementedError

    def in_shape(self, out_shape: Shape) -> Shape:
        """The input shape this hook turns into ``out_shape``; :class:`MappingError` when the output
        does not determine it. Default: a hook that leaves ``out_shape`` as it is left it as it was."""
        out_shape = tuple(out_shape)
        try:
            if tuple(self.out_shape(out_shape)) == out_shape:
                return out_shape
        except (MappingError, NotImplementedError, ValueError, IndexError):
            pass
        raise MappingError(f"{self}: the output shape {out_shape} does not determine the input shape")

    def forward(self, x: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def needed(self, out_box: Box, in_shape: Shape) -> Box:
        return full_box(in_shape)

    def selection(self, out_sel: Selection, in_shape: Shape) -> Selection:
        """The input elements ``out_sel`` needs (inside :meth:`needed` of its bounds); default: all of them."""
        return box_selection(self.needed(selection_bounds(out_sel), in_shape))

    def sibling_selection(self, out_sel: Selection, in_shape: Shape) -> Selection:
        """:meth:`selection` together with the input elements the hook's *siblings* need for the same
        ``out_sel`` — the other leaves that split the same tensor this way (a strided slice's other
        offsets) and so read the same pages; default: none beyond :meth:`selection`."""
        return self.selection(out_sel, in_shape)

    def apply(self, x: np.ndarray, in_box: Box, in_shape: Shape) -> tuple[np.ndarray, Box]:
        if not is_full(in_box, in_shape):
            raise MappingError(f"{self} needs the whole input tensor, got box {in_box}")
        return self.forward(x), full_box(self.out_shape(in_shape))

    def inverse(self, in_shape: Shape) -> Hook:
        raise MappingError(f"{self} has no inverse; this mapping cannot be exported")


@dataclass(frozen=True)
class Transpose(Hook):
    """Permute dimensions (``perm=None`` reverses them, the HF ``[out, in]`` → ``[in, out]`` case)."""

    perm: tuple[int, ...] | None = None

    def permutation(self, ndim: int) -> tuple[int, ...]:
        """Output dim ``i`` is input dim ``permutation(ndim)[i]``."""
        return tuple(range(ndim))[::-1] if self.perm is None else tuple(self.perm)

    def out_shape(self, in_shape: Shape) -> Shape:
        return tuple(in_shape[p] for p in self.permutation(len(in_shape)))

    def in_shape(self, out_shape: Shape) -> Shape:
        shape = [0] * len(out_shape)
        for out_dim, in_dim in enumerate(self.permutation(len(out_shape))):
            shape[in_dim] = out_shape[out_dim]
        return tuple(shape)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return x.transpose(self.permutation(x.ndim))

    def _out_dim_of(self, ndim: int) -> list[int]:
        """For each input dim, the output dim it becomes."""
        where = [0] * ndim
        for out_dim, in_dim in enumerate(self.permutation(ndim)):
            where[in_dim] = out_dim
        return where

    def needed(self, out_box: Box, in_shape: Shape) -> Box:
        return tuple(out_box[d] for d in self._out_dim_of(len(in_shape)))

    def selection(self, out_sel: Selection, in_shape: Shape) -> Selection:
        return tuple(out_sel[d] for d in self._out_dim_of(len(in_shape)))  # the dims permuted, whatever they hold

    def apply(self, x: np.ndarray, in_box: Box, in_shape: Shape) -> tuple[np.ndarray, Box]:
        perm = self.permutation(len(in_shape))
        return x.transpose(perm), tuple(in_box[p] for p in perm)

    def inverse(self, in_shape: Shape) -> Hook:
        return Transpose(tuple(int(i) for i in np.argsort(self.permutation(len(in_shape)))))


def head_run(spec: tuple[int | str, ...]) -> tuple[int, int] | None:
    """``(start, stop)`` of the one run of adjacent head-named entries of a reshape spec, extended
    by an adjacent ``-1`` when it is a single entry (``("rank", "heads", -1)``); None if ambiguous."""
    named = [isinstance(d, str) and "head" in d for d in spec]
    runs, start = [], None
    for i, flag in enumerate([*named, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    if len(runs) != 1:
        return None
    a, b = runs[0]
    if b - a == 1 and b < len(spec) and spec[b] == -1:
        b += 1
    elif b - a == 1 and a > 0 and spec[a - 1] == -1:
        a -= 1
    return (a, b) if b - a >= 2 else None


def reshape_groups(in_shape: Shape, out_shape: Shape) -> list[tuple[list[int], list[int]]]:
    """Pair runs of input and output dimensions with equal products (the dims a reshape regroups)."""
    if math.prod(in_shape) != math.prod(out_shape):
        raise MappingError(f"cannot reshape {in_shape} into {out_shape}")
    if 0 in in_shape or not in_shape or not out_shape:
        return [(list(range(len(in_shape))), list(range(len(out_shape))))]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(in_shape) and j < len(out_shape):
        gi, gj, pi, pj = [i], [j], in_shape[i], out_shape[j]
        i, j = i + 1, j + 1
        while pi != pj:  # equal totals guarantee a dim remains on the smaller side
            if pi < pj:
                gi.append(i)
                pi *= in_shape[i]
                i += 1
            else:
                gj.append(j)
                pj *= out_shape[j]
                j += 1
        groups.append((gi, gj))
    groups[-1][0].extend(range(i, len(in_shape)))  # trailing size-1 dims
    groups[-1][1].extend(range(j, len(out_shape)))
    return groups


@dataclass(frozen=True)
class Reshape(Hook):
    """Reshape to ``shape``; entries may be ints, ``-1`` or config field names.

    ``written`` is the spec as the table wrote it (field names kept), which :meth:`resolve` passes
    on: it is what :meth:`in_shape` reads to tell merged head dims apart.
    """

    shape: tuple[int | str, ...]
    written: tuple[int | str, ...] | None = field(default=None, compare=False, repr=False)

    def resolve(self, config: Mapping[str, Any]) -> Hook:
        dims = tuple(_config_int(config, d) if isinstance(d, str) else int(d) for d in self.shape)
        return Reshape(dims, written=self.written or self.shape)

    def in_shape(self, out_shape: Shape) -> Shape:
        """A reshape's output does not determine its input: ``[hidden, heads, head_dim]`` could come
        from ``[hidden, heads * head_dim]`` or from ``[hidden * heads, head_dim]``. HF checkpoints
        store attention projections with the head dims merged, so the input merges the one run of
        adjacent output dims the table names after head counts or sizes (config fields containing
        ``head``; a lone one with an adjacent ``-1``); any other spec raises :class:`MappingError`."""
        spec = self.written or self.shape
        run = head_run(tuple(spec))
        if run is None:
            raise MappingError(f"{Reshape(tuple(spec))}: the output shape {tuple(out_shape)} does not determine the "
                               "input shape (no single run of head-named dims to merge)")
        a, b = run
        return (*out_shape[:a], math.prod(out_shape[a:b]), *out_shape[b:])

    def out_shape(self, in_shape: Shape) -> Shape:
        if any(isinstance(d, str) for d in self.shape):
            raise MappingError(f"{self} was not resolved against a config")
        dims = [int(d) for d in self.shape]
        if -1 in dims:
            known = math.prod(d for d in dims if d != -1)
            dims[dims.index(-1)] = math.prod(in_shape) // known if known else 0
        if math.prod(dims) != math.prod(in_shape):
            raise MappingError(f"cannot reshape {tuple(in_shape)} into {tuple(self.shape)}")
        return tuple(int(d) for d in dims)

    def forward(self, x: np.ndarray) -> np.ndarray:
        return x.reshape(self.out_shape(x.shape))

    def needed(self, out_box: Box, in_shape: Shape) -> Box:
        out_shape = self.out_shape(in_shape)
        box: list[tuple[int, int] | None] = [None] * len(in_shape)
        for gi, gj in reshape_groups(in_shape, out_shape):
            in_dims, out_dims = [in_shape[d] for d in gi], [out_shape[d] for d in gj]
            lo, hi = flat_range(tuple(out_box[d] for d in gj), out_dims)
            # Grow the range until it is a box on both sides of the reshape (a fixpoint: ranges only
            # grow and the whole group is a box on both sides).
            while True:
                lo_in, hi_in = flat_range(cover_range(lo, hi, in_dims), in_dims)
                lo_out, hi_out = flat_range(cover_range(lo_in, hi_in, out_dims), out_dims)
                if (lo_out, hi_out) == (lo, hi) == (lo_in, hi_in):
                    break
                lo, hi = min(lo_in, lo_out), max(hi_in, hi_out)
            for d, span in zip(gi, cover_range(lo, hi, in_dims), strict=True):
                box[d] = span
        return cast(Box, tuple(box))  # the groups cover every input dim: no None is left

    def selection(self, out_sel: Selection, in_shape: Shape) -> Selection:
        out_shape = self.out_shape(in_shape)
        box = self.needed(selection_bounds(out_sel), in_shape)
        sel: list[tuple[tuple[int, int], ...]] = [(span,) for span in box]
        for gi, gj in reshape_groups(in_shape, out_shape):
            if len(gi) != 1:  # several input dims: a flat pattern is not a product of their intervals
                continue
            flat = _flat_intervals([out_sel[d] for d in gj], [out_shape[d] for d in gj])
            if flat is not None:
                sel[gi[0]] = flat
        return tuple(sel)

    def apply(self, x: np.ndarray, in_box: Box, in_shape: Shape) -> tuple[np.ndarray, Box]:
        out_shape = self.out_shape(in_shape)
        out_box: list[tuple[int, int] | None] = [None] * len(out_shape)
        for gi, gj in reshape_groups(in_shape, out_shape):
            in_dims, out_dims = [in_shape[d] for d in gi], [out_shape[d] for d in gj]
            lo, hi = flat_range(tuple(in_box[d] for d in gi), in_dims)
            spans = cover_range(lo, hi, out_dims) if hi > lo else tuple((0, 0) for _ in gj)
            if hi > lo and flat_range(spans, out_dims) != (lo, hi):
                raise MappingError(f"{self}: input box {in_box} does not map to an output box")
            for d, span in zip(gj, spans, strict=True):
                out_box[d] = span
        out_box_t = cast(Box, tuple(out_box))  # the groups cover every output dim: no None is left
        return x.reshape(tuple(b - a for a, b in out_box_t)), out_box_t

    def inverse(self, in_shape: Shape) -> Hook:
        return Reshape(tuple(in_shape))


@dataclass(frozen=True)
class Elementwise(Hook):
    """A hook acting on each element alone (shape kept, each box of the output needs the same box of
    the input); subclasses give :meth:`forward`."""

    def out_shape(self, in_shape: Shape) -> Shape:
        return tuple(in_shape)

    def in_shape(self, out_shape: Shape) -> Shape:
        return tuple(out_shape)

    def needed(self, out_box: Box, in_shape: Shape) -> Box:
        return out_box

    def selection(self, out_sel: Selection, in_shape: Shape) -> Selection:
        return out_sel

    def apply(self, x: np.ndarray, in_box: Box, in_shape: Shape) -> tuple[np.ndarray, Box]:
        return self.forward(x), in_box


def _widened(x: np.ndarray, constant: float | str, hook: Hook) -> tuple[np.ndarray, np.ndarray]:
    """``x`` in float32 at least and ``constant`` in that dtype: a hook's arithmetic, rounded once back
    to ``x.dtype`` by the caller (as a converter working in float32 writes it)."""
    if isinstance(constant, str):
        raise MappingError(f"{hook} was not resolved against a config")
    work = np.promote_types(x.dtype, np.float32)
    return (x if x.dtype == work else x.astype(work)), np.asarray(constant, dtype=work)


@dataclass(frozen=True)
class Scale(Elementwise):
    """Multiply by a constant, a config field or a config expression (``Scale("1 / sqrt(head_dim)")``);
    ``divide=True`` divides by it instead. The product is computed in float32 at least (a bfloat16
    tensor is widened, multiplied by ``float32(factor)`` and rounded once back to bfloat16, as a
    converter working in float32 writes it: MaxText's query pre-scale). The inverse divides
    (multiplies), so ``x * f / f`` round-trips where ``f`` is a power of two and to the last bit of
    rounding otherwise."""

    factor: float | str
    divide: bool = False

    def resolve(self, config: Mapping[str, Any]) -> Hook:
        if not isinstance(self.factor, str):
            return self
        return Scale(float(evaluate(self.factor, config)), self.divide)

    def forward(self, x: np.ndarray) -> np.ndarray:
        wide, factor = _widened(x, self.factor, self)
        scaled: np.ndarray = (wide / factor if self.divide else wide * factor).astype(x.dtype)
        return scaled

    def inverse(self, in_shape: Shape) -> Hook:
        return Scale(self.factor, not self.divide)


@dataclass(frozen=True)
class Shift(Elementwise):
    """Add a constant, a config field or expression: a norm scale stored as ``w`` for a model that
    reads ``1 + w`` as ``w`` (MaxText's Gemma RMSNorm: ``Shift(1.0)``, its converter's ``x + 1.0``).
    Computed in float32 at least and rounded once back, as :class:`Scale`. The inverse subtracts:
    ``(x + c) - c`` is ``x`` only to the rounding of ``x + c`` (a float32 ``w`` near 0 loses its low
    bits to the ``1``), so an export through it is exact to that rounding, not bit-exact."""

    amount: float | str

    def resolve(self, config: Mapping[str, Any]) -> Hook:
        if not isinstance(self.amount, str):
            return self
        return Shift(float(evaluate(self.amount, config)))

    def forward(self, x: np.ndarray) -> np.ndarray:
        wide, amount = _widened(x, self.amount, self)
        shifted: np.ndarray = (wide + amount).astype(x.dtype)
        return shifted

    def inverse(self, in_shape: Shape) -> Hook:
        return Shift(f"-({self.amount})" if isinstance(self.amount, str) else -self.amount)


@dataclass(frozen=True)
class Pad(Hook):
    """Grow one axis to ``size`` (an int, config field or expression), the new rows ``value``: a
    vocabulary padded past the checkpoint's (``Pad(0, "padded_vocab_size")``). The inverse slices the
    padding off again. ``original`` (optional, same kinds) is the stored length, so that an export
    without a reference checkpoint knows it (:meth:`in_shape`); a stored axis longer than ``size``
    is a :class:`MappingError`, never a silent cut."""

    axis: int
    size: int | str
    value: float = 0.0
    original: int | str | None = None

    def resolve(self, config: Mapping[str, Any]) -> Hook:
        size = _config_int(config, self.size) if isinstance(self.size, str) else self.size
        original = _config_int(config, self.original) if isinstance(self.original, str) else self.original
        return dataclasses.replace(self, size=size, original=original)

    def _size(self) -> int:
        if isinstance(self.size, str) or isinstance(self.original, str):
            raise MappingError(f"{self} was not resolved against a config")
        return self.size

    def out_shape(self, in_shape: Shape) -> Shape:
        axis, size = self.axis % len(in_shape), self._size()
        if in_shape[axis] > size:
            raise MappingError(f"{self}: the stored axis {axis} has {in_shape[axis]} entries, more than the {size} "
                               "it pads to")
        if self.original is not None and in_shape[axis] != self.original:
            raise MappingError(f"{self}: the stored axis {axis} has {in_shape[axis]} entries, not {self.original}")
        shape = list(in_shape)
        shape[axis] = size
        return tuple(shape)

    def in_shape(self, out_shape: Shape) -> Shape:
        if self.original is None:
            raise MappingError(f"{self}: the padded shape {tuple(out_shape)} does not determine the stored length "
                               "(give original=)")
        shape = list(out_shape)
        shape[self.axis % len(shape)] = int(self.original)
        return tuple(shape)

    def forward(self, x: np.ndarray) -> np.ndarray:
        axis = self.axis % x.ndim
        widths = [(0, 0)] * x.ndim
        widths[axis] = (0, self._size() - x.shape[axis])
        return _pad(x, widths, self.value)

    def needed(self, out_box: Box, in_shape: Shape) -> Box:
        """The stored rows of ``out_box``; a box wholly in the padding still reads the last stored row
        (a box is never empty)."""
        axis = self.axis % len(in_shape)
        n, (lo, hi) = in_shape[axis], out_box[axis]
        box = list(out_box)
        box[axis] = (min(lo, n - 1), max(min(hi, n), min(lo, n - 1) + 1))
        return tuple(box)

    def apply(self, x: np.ndarray, in_box: Box, in_shape: Shape) -> tuple[np.ndarray, Box]:
        axis = self.axis % len(in_shape)
        lo, hi = in_box[axis]
        box = list(in_box)
        if hi == in_shape[axis]:  # the box reaches the stored end: the padding follows it
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, self._size() - hi)
            x = _pad(x, widths, self.value)
            box[axis] = (lo, self._size())
        return x, tuple(box)

    def inverse(self, in_shape: Shape) -> Hook:
        return Slice(self.axis % len(in_shape), 0, in_shape[self.axis % len(in_shape)])


@dataclass(frozen=True)
class Slice(Hook):
    """Keep ``start:stop:step`` of one axis: splits fused tensors (QKV, gate/up, interleaved pairs).

    ``start``/``stop`` may name config fields. Several leaves can take different slices of the same
    HF tensor; each reads only its part.
    """

    axis: int
    start: int | str = 0
    stop: int | str | None = None
    step: int = 1

    def resolve(self, config: Mapping[str, Any]) -> Hook:
        start = _config_int(config, self.start) if isinstance(self.start, str) else self.start
        stop = _config_int(config, self.stop) if isinstance(self.stop, str) else self.stop
        return dataclasses.replace(self, start=start, stop=stop)

    def positions(self, n: int) -> range:
        """The indices this slice keeps of an axis of length ``n``."""
        if isinstance(self.start, str) or isinstance(self.stop, str):
            raise MappingError(f"{self} was not resolved against a config")
        return range(n)[slice(self.start, self.stop, self.step)]

    def out_shape(self, in_shape: Shape) -> Shape:
        shape = list(in_shape)
        shape[self.axis] = len(self.positions(in_shape[self.axis]))
        return tuple(shape)

    def in_shape(self, out_shape: Shape) -> Shape:
        if self.start in (0, None) and self.stop is None and self.step == 1:  # keeps the whole axis
            return tuple(out_shape)
        raise MappingError(f"{self} keeps part of axis {self.axis}: the output shape {tuple(out_shape)} does not "
                           "determine the input shape")

    def forward(self, x: np.ndarray) -> np.ndarray:
        index = [slice(None)] * x.ndim
        index[self.axis] = slice(self.start, self.stop, self.step)
        return x[tuple(index)]

    def needed(self, out_box: Box, in_shape: Shape) -> Box:
        axis = self.axis % len(in_shape)
        kept = self.positions(in_shape[axis])
        lo, hi = out_box[axis]
        box = list(out_box)
        box[axis] = (kept[lo], kept[hi - 1] + 1) if hi > lo else (0, 0)
        return tuple(box)

    def selection(self, out_sel: Selection, in_shape: Shape) -> Selection:
        axis = self.axis % len(in_shape)
        kept = self.positions(in_shape[axis])
        spans: list[tuple[int, int]] = []
        for lo, hi in out_sel[axis]:
            picked = kept[lo:hi]
            if abs(picked.step) == 1 and len(picked):
                spans.append((min(picked[0], picked[-1]), max(picked[0], picked[-1]) + 1))
            else:  # a strided slice needs every step-th element: one interval each
                spans.extend((p, p + 1) for p in picked)
        sel = list(out_sel)
        sel[axis] = merge_intervals(spans)
        return tuple(sel)

    def sibling_selection(self, out_sel: Selection, in_shape: Shape) -> Selection:
        """A strided slice (``step`` > 1, the whole axis) interleaves ``step`` sibling slices, one per
        offset (GPT-OSS ``gate_up_proj``: ``gate`` even, ``up`` odd): for each kept element, its whole
        group of ``step`` elements."""
        axis = self.axis % len(in_shape)
        if self.step <= 1 or self.stop is not None or not isinstance(self.start, int) or self.start >= self.step:
            return self.selection(out_sel, in_shape)
        n, kept = in_shape[axis], self.positions(in_shape[axis])
        spans = [(kept[lo] - self.start, min(n, kept[hi - 1] - self.start + self.step))
                 for lo, hi in out_sel[axis] if hi > lo]
        sel = list(out_sel)
        sel[axis] = merge_intervals(spans)
        return tuple(sel)

    def apply(self, x: np.ndarray, in_box: Box, in_shape: Shape) -> tuple[np.ndarray, Box]:
        axis = self.axis % len(in_shape)
        kept = self.positions(in_shape[axis])
        a, b = in_box[axis]
        positions = [j for j, p in enumerate(kept) if a <= p < b]
        lo, hi = (positions[0], positions[-1] + 1) if positions else (0, 0)
        index = [slice(None)] * x.ndim
        index[axis] = slice(kept[lo] - a, kept[hi - 1] - a + 1, kept.step) if positions else slice(0, 0)
        box = list(in_box)
        box[axis] = (lo, hi)
        return x[tuple(index)], tuple(box)


def _pad(x: np.ndarray, widths: list[tuple[int, int]], value: float) -> np.ndarray:
    """``x`` padded by ``widths`` with ``value``, in ``x``'s own array library (numpy on the host,
    ``jax.numpy`` where the hooks run on the device)."""
    padded: np.ndarray = x.__array_namespace__().pad(x, widths, constant_values=value)
    return padded


def _flat_intervals(
    spans: Sequence[tuple[tuple[int, int], ...]], dims: Sequence[int]
) -> tuple[tuple[int, int], ...] | None:
    """The row-major flat intervals of the product of ``spans`` over ``dims`` (merged), or None
    when there would be more than :data:`MAX_RESHAPE_INTERVALS`."""
    if not dims:
        return ((0, 1),)
    inner = math.prod(dims[1:])
    sub = _flat_intervals(spans[1:], dims[1:])
    if sub is None:
        return None
    if sub == ((0, inner),):
        return merge_intervals([(a * inner, b * inner) for a, b in spans[0]])
    count = sum(b - a for a, b in spans[0]) * len(sub)
    if count > MAX_RESHAPE_INTERVALS:
        return None
    rows = (i * inner for a, b in spans[0] for i in range(a, b))
    return merge_intervals([(row + lo, row + hi) for row in rows for lo, hi in sub])


def run_forward(hooks: Sequence[Hook], x: np.ndarray) -> np.ndarray:
    """Apply ``hooks`` to a whole tensor."""
    for hook in hooks:
        x = hook.forward(x)
    return x


def chain_shapes(hooks: Sequence[Hook], in_shape: Shape) -> list[Shape]:
    """Input shape of every hook, then the final output shape (``len(hooks) + 1`` entries)."""
    shapes = [tuple(in_shape)]
    for hook in hooks:
        shapes.append(tuple(hook.out_shape(shapes[-1])))
    return shapes


def chain_needed(hooks: Sequence[Hook], shapes: Sequence[Shape], out_box: Box) -> Box:
    """The box of the source tensor that covers ``out_box`` of the chain's output."""
    box = out_box
    for hook, in_shape in zip(reversed(hooks), reversed(shapes[:-1]), strict=True):
        box = hook.needed(box, in_shape)
    return box


def chain_selection(hooks: Sequence[Hook], shapes: Sequence[Shape], out_box: Box, siblings: bool = False) -> Selection:
    """The elements of the source tensor ``out_box`` of the chain's output needs: inside
    :func:`chain_needed`'s box, without the holes widening hooks leave. With ``siblings``, also the
    elements sibling leaves read through the same hooks (:meth:`Hook.sibling_selection`): the holes
    of the selection inside it are theirs."""
    sel = box_selection(out_box)
    for hook, in_shape in zip(reversed(hooks), reversed(shapes[:-1]), strict=True):
        sel = hook.sibling_selection(sel, in_shape) if siblings else hook.selection(sel, in_shape)
    return sel


def chain_apply(hooks: Sequence[Hook], shapes: Sequence[Shape], x: np.ndarray, box: Box) -> tuple[np.ndarray, Box]:
    """Carry the part ``box`` of the source through every hook; returns the result and its box."""
    for hook, in_shape in zip(hooks, shapes[:-1], strict=True):
        x, box = hook.apply(x, box, in_shape)
    return x, box
