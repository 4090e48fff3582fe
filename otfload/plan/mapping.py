"""Declarative mapping tables: target leaf path ↔ HF key template + hooks.

A :class:`Rule` says where one kind of target leaf comes from::

    Rule("layers.{layer}.attn.q.kernel", "model.layers.{layer}.self_attn.q_proj.weight",
         (Transpose(), Reshape((-1, "num_attention_heads", "head_dim"))))

Placeholders (``{layer}``, ``{expert}``) tie the two templates together. A placeholder that is a
path segment of the *actual* leaf (``layers.3.attn.q.kernel``) selects one HF tensor; one that is
absent from the leaf path (a scanned ``layers.attn.q.kernel``, or ``{expert}`` when the target
never names experts) becomes a *stack axis*: the leaf gains a leading dimension over it and is
built from many HF tensors with one ``np.stack``. ``stack_order`` fixes the order of those axes
when the default (target-template order, then HF-template order) is not what the model wants, and
``stack_at`` where they land: by default they lead the leaf; ``stack_at={"layer": "param_scan_axis"}``
puts the layer axis at that dimension (MaxText's scanned ``[embed, layers, heads, head_dim]``), the
other stack axes taking the lowest dimensions left, in stack order (:func:`stack_dims`).

Rules are plain data: the same table drives loading, ``otfload inspect`` and export (which runs the
hooks' inverses). One HF key may feed several leaves (tied embeddings); nothing is consumed.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import re
from collections.abc import Iterator, Sequence
from collections.abc import Mapping as MappingABC
from dataclasses import dataclass, field
from typing import Any

from otfload.errors import MappingError
from otfload.plan.expressions import integer
from otfload.plan.hooks import Hook

_PLACEHOLDER = re.compile(r"\{(\w+)\}")
# Compiled target patterns kept by template: every leaf path is matched against the rules in order,
# and building a rule's pattern each time was 6 % of an unscanned load (165 leaves × 14 rules).
TARGET_REGEX_CACHE_SIZE = 1024
# Most HF tensors one leaf may stack: DeepSeek-V3's experts are 58 layers x 256 = 14,848; 70x room.
# A larger stack comes from a hostile config or abstract tree, and enumerating it would not end.
MAX_STACK_SLICES = 1 << 20


def placeholders(template: str) -> list[str]:
    """Placeholder names in order of first appearance."""
    seen: list[str] = []
    for name in _PLACEHOLDER.findall(template):
        if name not in seen:
            seen.append(name)
    return seen


@functools.lru_cache(maxsize=TARGET_REGEX_CACHE_SIZE)
def _target_regex(template: str) -> re.Pattern[str]:
    """A regex matching leaf paths of ``template`` with each ``{name}.`` segment optional."""
    parts, pos = [], 0
    for m in re.finditer(r"\{(\w+)\}\.?", template):
        parts.append(re.escape(template[pos : m.start()]))
        dot = r"\." if m.group(0).endswith(".") else ""
        parts.append(rf"(?:(?P<{m.group(1)}>\d+){dot})?")
        pos = m.end()
    parts.append(re.escape(template[pos:]))
    return re.compile("".join(parts) + r"\Z")


@dataclass(frozen=True)
class Rule:
    """One target-leaf template, the HF key template(s) feeding it, and the hooks between them.

    ``fallbacks`` are HF templates tried in order when ``source`` is absent (a key some checkpoints
    store under another name; never a stand-in for a tensor the config says exists). ``offsets`` shift placeholder
    values on the HF side (``{"layer": "first_k_dense_replace"}`` for a group of layers that
    starts after the dense ones); values may be config field names. ``indices`` give a group whose
    layers are not contiguous its HF values explicitly: ``{"layer": "moe_layers"}`` makes position
    ``i`` of ``{layer}`` (in the leaf path or on a stack axis) read HF layer ``config["moe_layers"][i]``;
    the values may be names: ``{"part": ("k", "v")}`` with source ``…self_attn.{part}_proj.weight``
    stacks the k and v projections on the leaf's leading axis (a fused ``[2, heads, …]`` weight);
    ``{"layer": Stride(6, 5)}`` reads HF layers 5, 11, 17, … (one kind of layer in a repeating block);
    ``{"layer": Composed(("block", "local"), "block * 4 + local")}`` makes ``{layer}`` no stack axis
    but the value of two (a leaf stacking layers twice, ``[blocks, position in block]``).
    ``only`` restricts the rule to leaves whose path names a placeholder with one of the listed
    values, ints or literal :class:`Stride` s: ``{"layer": (Stride(6, 5),)}`` matches
    ``layers_5.…``, ``layers_11.…`` and no other layer (layers of several kinds at the same leaf
    paths, with other shapes: Gemma 4's global attention every sixth layer; a table built from a
    config's ``layer_types`` lists the indices). A leaf that stacks the placeholder is not matched.
    ``cast=True`` says an integer, boolean or unscaled FP8 tensor is meant to become a float leaf;
    without it such a cast is an :class:`~otfload.errors.UnfaithfulCastError`. ``stack_at`` gives
    the leaf dimension a stack axis lands at (an int, config field or expression); an axis it does
    not name is placed by :func:`stack_dims`, and a name that is no stack axis of a leaf (a scanned
    rule's ``layer`` on an unscanned tree) is ignored there.
    """

    target: str
    source: str
    hooks: tuple[Hook, ...] = ()
    fallbacks: tuple[str, ...] = ()
    stack_order: tuple[str, ...] | None = None
    offsets: MappingABC[str, int | str] = field(default_factory=dict)
    indices: MappingABC[str, Sequence[int | str] | str | Stride | Composed] = field(default_factory=dict)
    cast: bool = False
    stack_at: MappingABC[str, int | str] = field(default_factory=dict)
    # ``source`` names no stored tensor but HF tensors joined on their first axis (:class:`Join`)
    join: Join | None = None
    only: MappingABC[str, tuple[int | Stride, ...]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = set(placeholders(self.target)) - set(placeholders(self.source))
        if missing:
            raise MappingError(f"rule {self.target!r}: placeholders {sorted(missing)} not in {self.source!r}")
        for name, allowed in self.only.items():
            if name not in placeholders(self.target):
                raise MappingError(f"rule {self.target!r}: only={{{name!r}: ...}} names no placeholder of the target")
            odd = [v for v in allowed if not isinstance(v, int | Stride) or isinstance(v, Stride) and not v.literal]
            if odd:
                raise MappingError(f"rule {self.target!r}: only[{name!r}] takes ints and Strides of ints, not {odd}")
        named = [k for k, v in self.indices.items() if isinstance(v, Composed) and k in placeholders(self.target)]
        if named:
            raise MappingError(f"rule {self.target!r}: {named} composed of stack axes cannot be in the target path")

    @property
    def regex(self) -> re.Pattern[str]:
        return _target_regex(self.target)

    def match(self, leaf_path: str) -> tuple[dict[str, int], tuple[str, ...]] | None:
        """``(fixed placeholder values, stack axis names)`` if ``leaf_path`` is this rule's, else None."""
        m = self.regex.match(leaf_path)
        if m is None:
            return None
        fixed = {k: int(v) for k, v in m.groupdict().items() if v is not None}
        if not all(k in fixed and _selected(fixed[k], allowed) for k, allowed in self.only.items()):
            return None
        stacked = [k for k in placeholders(self.target) if k not in fixed]
        stacked += [k for k in placeholders(self.source) if k not in fixed and k not in stacked]
        stacked = [axis for k in stacked for axis in _composed_axes(k, self.indices) if axis not in fixed]
        if self.stack_order is not None:
            if sorted(self.stack_order) != sorted(stacked):
                return None
            stacked = list(self.stack_order)
        return fixed, tuple(stacked)


@dataclass(frozen=True)
class MappingTable:
    """An ordered list of rules; the first rule whose target template matches a leaf wins."""

    rules: tuple[Rule, ...]
    # HF keys that may be present but are never loaded (e.g. rotary buffers): not "unexpected".
    ignore: tuple[str, ...] = ()

    def find(self, leaf_path: str) -> tuple[Rule, dict[str, int], tuple[str, ...]] | None:
        for rule in self.rules:
            found = rule.match(leaf_path)
            if found is not None:
                return rule, *found
        return None

    def ignored(self, hf_key: str) -> bool:
        return any(re.fullmatch(pattern, hf_key) for pattern in self.ignore)

    def __add__(self, other: MappingTable) -> MappingTable:
        return MappingTable(self.rules + other.rules, self.ignore + other.ignore)

    def with_source_prefixes(self, prefixes: MappingABC[str, str]) -> MappingTable:
        """The same table reading HF keys under other prefixes, e.g. a text model's table used on a
        multimodal checkpoint: ``{"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}``."""

        def rename(key: str) -> str:
            for old, new in prefixes.items():
                if key.startswith(old):
                    return new + key[len(old) :]
            return key

        def joined(join: Join | None) -> Join | None:
            return None if join is None else dataclasses.replace(
                join, parts=tuple((rename(template), blocks) for template, blocks in join.parts))

        rules = tuple(
            dataclasses.replace(r, source=rename(r.source), fallbacks=tuple(map(rename, r.fallbacks)),
                                join=joined(r.join))
            for r in self.rules
        )
        return MappingTable(rules, self.ignore)


def as_table(mapping: MappingTable | Sequence[Rule] | MappingABC[str, str]) -> MappingTable:
    """Accept a table, a list of rules, or a plain ``{target template: HF template}`` dict."""
    if isinstance(mapping, MappingTable):
        return mapping
    if isinstance(mapping, MappingABC):
        return MappingTable(tuple(Rule(t, s) for t, s in mapping.items()))
    return MappingTable(tuple(mapping))


def _resolve_offset(value: int | str, config: MappingABC[str, Any]) -> int:
    if isinstance(value, str):
        if value not in config:
            raise MappingError(f"rule offset refers to config field {value!r}, which the config does not have")
        return int(config[value])
    return int(value)


@dataclass(frozen=True)
class Stride:
    """HF values ``start + period * i`` for position ``i`` of a placeholder (``Rule.indices``): the
    ``j``-th layer of every block of ``period`` (Gemma's global layer every 6th, Llama 4's MoE layer
    every other). ``period`` and ``start`` may be config fields or expressions."""

    period: int | str
    start: int | str = 0

    @property
    def literal(self) -> bool:
        """Whether ``period`` and ``start`` are numbers (a stride known without a config)."""
        return all(isinstance(v, int) and not isinstance(v, bool) for v in (self.period, self.start))

    def __contains__(self, value: object) -> bool:
        """Whether the literal stride takes ``value`` (:attr:`Rule.only`)."""
        if not self.literal:
            raise MappingError(f"{self}: membership needs a literal period and start")
        period, start = int(self.period), int(self.start)
        return isinstance(value, int) and value >= start and (value - start) % period == 0

    def values(self, config: MappingABC[str, Any]) -> range:
        period = integer(self.period, config, f"{self}: period")
        start = integer(self.start, config, f"{self}: start")
        if period < 1 or start < 0:
            raise MappingError(f"{self}: period {period} and start {start} name no layers")
        return range(start, start + period * MAX_STACK_SLICES, period)


@dataclass(frozen=True)
class Composed:
    """An HF value computed from the positions of several stack axes (``Rule.indices``): a leaf that
    stacks layers twice, ``[blocks, position in block]`` (MaxText's scanned Qwen3-Next), reads HF
    layer ``block * period + local`` with ``Composed(("block", "local"), "block * period + local")``.
    ``axes`` become the leaf's stack axes in place of the placeholder, in that order; ``value`` is an
    expression over their positions (from 0) and config fields."""

    axes: tuple[str, ...]
    value: str


@dataclass(frozen=True)
class Join:
    """A rule's source made of several HF tensors joined head by head on their first axis
    (``Rule.join``; MaxText's Qwen3.5 ``in_proj_qkvz``). ``parts`` are HF key templates, each with the
    row counts of its blocks (expressions: ``in_proj_qkv`` is a q, a k and a v block); every block holds
    ``heads`` equal runs of rows, and the joined tensor has, head by head, that head's run of every
    block in order (:func:`otfload.index.concat.head_blocks`). Each HF tensor is read only where a
    device's box needs it, and export writes each back."""

    parts: tuple[tuple[str, tuple[str, ...]], ...]
    heads: str

    def sources(
        self, values: MappingABC[str, int | str], config: MappingABC[str, Any]
    ) -> list[tuple[str, tuple[int, ...]]]:
        """Each part's HF key for the placeholder ``values`` and its blocks' row counts."""
        return [(format_key(template, values), tuple(integer(b, config, f"{template}: block") for b in blocks))
                for template, blocks in self.parts]

    def head_count(self, config: MappingABC[str, Any]) -> int:
        return integer(self.heads, config, f"join of {[t for t, _ in self.parts]}: heads")


def _selected(value: int, allowed: tuple[int | Stride, ...]) -> bool:
    """Whether a path value is one :attr:`Rule.only` lists (an int equal to it, a stride taking it)."""
    return any(value in a if isinstance(a, Stride) else value == a for a in allowed)


def _composed_axes(name: str, indices: MappingABC[str, object]) -> tuple[str, ...]:
    """The stack axes placeholder ``name`` stands for: its :class:`Composed` axes, or itself."""
    value = indices.get(name)
    return value.axes if isinstance(value, Composed) else (name,)


def _resolve_indices(
    value: Sequence[int | str] | str | Stride, config: MappingABC[str, Any]
) -> Sequence[int | str]:
    if isinstance(value, Stride):
        return value.values(config)
    if isinstance(value, str):
        if value not in config:
            raise MappingError(f"rule indices refer to config field {value!r}, which the config does not have")
        listed: Sequence[int | str] = config[value]
    else:
        listed = value
    return tuple(v if isinstance(v, str) else int(v) for v in listed)


def _hf_value(
    name: str, position: int, offsets: MappingABC[str, int], indices: MappingABC[str, Sequence[int | str]]
) -> int | str:
    """The HF value of placeholder ``name`` at ``position`` of the leaf (path index or stack index)."""
    if name not in indices:
        return position + offsets.get(name, 0)
    if position >= len(indices[name]):
        raise MappingError(f"rule indices for {{{name}}} list {len(indices[name])} values; position {position} asked")
    return indices[name][position]


def slice_values(
    rule: Rule,
    fixed: MappingABC[str, int],
    stack_axes: Sequence[str],
    stack_shape: Sequence[int],
    config: MappingABC[str, Any],
) -> Iterator[tuple[tuple[int, ...], dict[str, int | str]]]:
    """For every stack slice of a leaf (row-major), its index and the HF placeholder values that
    name its tensor: leaf positions shifted by ``offsets`` or looked up in ``indices``."""
    count = math.prod(stack_shape)
    if count > MAX_STACK_SLICES:
        raise MappingError(
            f"rule {rule.target!r}: the leaf stacks {count} tensors (shape {tuple(stack_shape)}), more than the "
            f"{MAX_STACK_SLICES} any checkpoint holds"
        )
    resolved = _resolved(rule, config)
    for combo in itertools.product(*(range(n) for n in stack_shape)):
        yield combo, _values(rule, resolved, {**fixed, **dict(zip(stack_axes, combo, strict=True))}, config)


def _resolved(
    rule: Rule, config: MappingABC[str, Any]
) -> tuple[dict[str, int], dict[str, Sequence[int | str]]]:
    offsets = {k: _resolve_offset(v, config) for k, v in rule.offsets.items()}
    return offsets, {k: _resolve_indices(v, config) for k, v in rule.indices.items() if not isinstance(v, Composed)}


def _values(
    rule: Rule, resolved: tuple[dict[str, int], dict[str, Sequence[int | str]]], positions: MappingABC[str, int],
    config: MappingABC[str, Any],
) -> dict[str, int | str]:
    """The HF placeholder values for the leaf ``positions`` (path values and stack indices), the
    :class:`Composed` ones computed from their axes' positions."""
    offsets, indices = resolved
    values = {k: _hf_value(k, v, offsets, indices) for k, v in positions.items()}
    for name, spec in rule.indices.items():
        if isinstance(spec, Composed):
            scope = {**config, **{axis: positions[axis] for axis in spec.axes}}
            values[name] = integer(spec.value, scope, f"rule {rule.target!r}: {{{name}}}")
    return values


def hf_values(
    rule: Rule, fixed: MappingABC[str, int], stack_axes: Sequence[str], position: Sequence[int],
    config: MappingABC[str, Any],
) -> dict[str, int | str]:
    """The HF placeholder values of the stack slice at ``position`` (one of :func:`slice_values`)."""
    return _values(rule, _resolved(rule, config), {**fixed, **dict(zip(stack_axes, position, strict=True))}, config)


def stack_dims(rule: Rule, stack_axes: Sequence[str], ndim: int, config: MappingABC[str, Any]) -> tuple[int, ...]:
    """The leaf dimension of each of ``stack_axes`` (in their order): those ``rule.stack_at`` names
    where it says, the others on the lowest dimensions left, in order. A position outside the leaf's
    ``ndim`` dimensions, or two axes on one dimension, is a :class:`MappingError` naming them."""
    placed: dict[str, int] = {}
    for name in stack_axes:
        if name in rule.stack_at:
            dim = integer(rule.stack_at[name], config, f"rule {rule.target!r}: stack_at[{name!r}]")
            if not 0 <= dim < ndim:
                raise MappingError(f"rule {rule.target!r}: stack axis {name!r} at dimension {dim} "
                                   f"({rule.stack_at[name]!r}) of a {ndim}-dimensional leaf")
            placed[name] = dim
    taken = sorted(placed.values())
    if len(set(taken)) != len(taken):
        raise MappingError(f"rule {rule.target!r}: stack axes {placed} share a dimension")
    free = iter(d for d in range(ndim) if d not in placed.values())
    return tuple(placed[name] if name in placed else next(free) for name in stack_axes)


def format_key(template: str, values: MappingABC[str, int | str]) -> str:
    return _PLACEHOLDER.sub(lambda m: str(values[m.group(1)]), template)
