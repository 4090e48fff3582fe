"""Config against checkpoint: the counts and sizes ``config.json`` claims must be those of the tensors present.

Checked from tensor names and header shapes alone, in one pass over the names, before the model is
built or a key is planned, so a config naming a billion layers (or experts) fails in microseconds
instead of enumerating a billion keys. Each family lists its checks (:class:`Count`, :class:`Dim`);
a violation is a :class:`~otfload.errors.ConfigError` naming the field, its value and what the
checkpoint holds.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from otfload.errors import ConfigError
from otfload.plan.mapping import MappingTable

# An index in a tensor name: no leading zeros (the planner formats keys without them) and short
# enough that int() never meets Python's digit limit on a hostile name.
_INDEX = r"(0|[1-9][0-9]{0,17})"
_PLACEHOLDER = re.compile(r"\\\{(\w+)\\\}")


@runtime_checkable
class Shaped(Protocol):
    """What a size check reads of a checkpoint tensor (a header's ``TensorInfo``, a derived tensor)."""

    @property
    def name(self) -> str: ...

    @property
    def shape(self) -> tuple[int, ...]: ...


@dataclass(frozen=True)
class Count:
    """Config field ``field`` = ``value`` counts the ``{placeholder}`` values (``layer``, ``expert``) of
    the family's tensor names: the checkpoint must hold exactly indices ``0 .. value - 1``, plus at most
    ``extra`` more (DeepSeek-V3's multi-token-prediction layers, stored after the last layer)."""

    field: str
    value: int
    placeholder: str
    extra: int = 0


@dataclass(frozen=True)
class Dim:
    """Axis ``axis`` of ``tensor`` (in the first layer that has it when the name holds ``{layer}``) must
    be ``value``, times ``per`` (``(field name, value)``) when given: e.g. q_proj rows =
    ``num_attention_heads × head_dim``."""

    field: str
    value: int
    tensor: str
    axis: int
    per: tuple[str, int] | None = None

    @property
    def expected(self) -> int:
        return self.value * (self.per[1] if self.per else 1)


TensorCheck = Count | Dim


def _index_regex(table: MappingTable, placeholder: str) -> re.Pattern[str] | None:
    """Matches the tensor names of ``table``'s sources up to ``{placeholder}``, capturing its value."""
    prefixes = set()
    for rule in table.rules:
        for template in (rule.source, *rule.fallbacks):
            mark = "{" + placeholder + "}"
            if mark in template:
                prefixes.add(template[: template.index(mark)])
    if not prefixes:
        return None
    # Other placeholders before this one (``{layer}`` before ``{expert}``) match any index.
    alternatives = sorted(_PLACEHOLDER.sub(_INDEX.replace("(", "(?:", 1), re.escape(p)) for p in prefixes)
    return re.compile(f"(?:{'|'.join(alternatives)}){_INDEX}\\.")


def present_indices(table: MappingTable, names: Iterable[str], placeholder: str) -> set[int]:
    """Every value of ``{placeholder}`` found in ``names`` at the positions ``table``'s sources put it."""
    regex = _index_regex(table, placeholder)
    if regex is None:
        return set()
    found = set()
    for name in names:
        m = regex.match(name)
        if m is not None:
            found.add(int(m.group(1)))
    return found


def _spans(indices: set[int]) -> str:
    """``{0, 1, 2, 5}`` as ``0-2, 5`` (at most a few spans shown)."""
    if not indices:
        return "none"
    ordered, spans = sorted(indices), []
    start = prev = ordered[0]
    for i in [*ordered[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        spans.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(spans[:4]) + (f", ... ({len(spans) - 4} more ranges)" if len(spans) > 4 else "")


def _check_count(check: Count, present: set[int]) -> None:
    wanted = set(range(check.value)) if check.value <= len(present) else None
    allowed = check.value + check.extra
    if wanted is None or not wanted <= present or max(present, default=-1) >= allowed:
        named = f"{check.placeholder}s 0-{check.value - 1}" if check.value else f"no {check.placeholder}s"
        extra = f" (plus up to {check.extra} more)" if check.extra else ""
        raise ConfigError(
            check.field, check.value,
            f"must match the checkpoint: the config names {named}{extra} but the tensors hold "
            f"{len(present)} {check.placeholder} indices ({_spans(present)})",
        )


def _check_dim(check: Dim, tensors: Mapping[str, object], layers: Sequence[int]) -> None:
    names = [check.tensor.format(layer=i) for i in layers] if "{layer}" in check.tensor else [check.tensor]
    info = next((tensors[n] for n in names if n in tensors), None)
    if not isinstance(info, Shaped):
        return  # absent: the planner reports the missing tensor
    shape = info.shape
    if len(shape) <= check.axis or shape[check.axis] == check.expected:
        return  # absent or of another rank: the planner reports the tensor itself
    per = f" × {check.per[0]} ({check.per[1]})" if check.per else ""
    raise ConfigError(
        check.field, check.value,
        f"must match the checkpoint: {check.field}{per} = {check.expected} but {info.name} has "
        f"shape {tuple(shape)} (axis {check.axis} is {shape[check.axis]})",
    )


def check_tensors(checks: Sequence[TensorCheck], table: MappingTable, tensors: Mapping[str, object]) -> None:
    """Raise a ConfigError for the first check the checkpoint's ``tensors`` (name → info with
    ``.shape``) contradict; counts first, so sizes are looked up only in layers that exist."""
    present: dict[str, set[int]] = {}
    for check in checks:
        if isinstance(check, Count):
            if check.placeholder not in present:
                present[check.placeholder] = present_indices(table, tensors, check.placeholder)
            _check_count(check, present[check.placeholder])
    layers = sorted(present.get("layer", ()))
    for check in checks:
        if isinstance(check, Dim):
            _check_dim(check, tensors, layers)
