"""Which table a MaxText run needs, read from its config alone, and the checks that the abstract
tree and the checkpoint are the ones that config describes — all before any tensor byte is read.

The table comes from ``model_name`` (MaxText's own names, as its converter's ``PARAM_MAPPING``
keys them; an ``-Instruct`` suffix is dropped as MaxText drops it) and the layout from
``scan_layers`` and ``param_scan_axis``; shapes are only checked against those fields, never used
to guess them. Every refusal is a :class:`~otfload.errors.ConfigError` whose ``field`` is the
MaxText field and whose message names the otfload table.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.errors import ConfigError
from otfload.maxtext.deepseek import DEEPSEEK2, DEEPSEEK3, DEEPSEEK32
from otfload.maxtext.gemma import GEMMA2, GEMMA3
from otfload.maxtext.gemma4 import GEMMA4_DENSE, GEMMA4_MOE
from otfload.maxtext.gemma4_small import GEMMA4_E2B, GEMMA4_E4B
from otfload.maxtext.gpt_oss import GPT_OSS
from otfload.maxtext.llama import LLAMA31
from otfload.maxtext.llama4 import LLAMA4_MAVERICK, LLAMA4_SCOUT
from otfload.maxtext.mixtral import MIXTRAL
from otfload.maxtext.olmo3 import OLMO3
from otfload.maxtext.qwen2 import QWEN2
from otfload.maxtext.qwen3 import QWEN3, QWEN3_MOE
from otfload.maxtext.qwen3_5 import QWEN3_5, QWEN3_5_FP8
from otfload.maxtext.qwen3_next import QWEN3_NEXT
from otfload.maxtext.tables import EXPERTS, LOGITS, LayerGroup, ModelTable
from otfload.plan import expressions
from otfload.plan.mapping import MappingTable, stack_dims

SOURCE = "MaxText config"
TABLES: dict[str, ModelTable] = {
    **dict.fromkeys(("llama3.1-8b", "llama3.1-70b", "llama3.1-405b"), LLAMA31),
    "llama4-17b-16e": LLAMA4_SCOUT,
    "llama4-17b-128e": LLAMA4_MAVERICK,
    **dict.fromkeys(("qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b"), QWEN2),
    **dict.fromkeys(("qwen3-0.6b", "qwen3-1.7b", "qwen3-1.7b-base", "qwen3-4b", "qwen3-4b-base",
                     "qwen3-4b-thinking-2507", "qwen3-8b", "qwen3-8b-base", "qwen3-14b", "qwen3-14b-base",
                     "qwen3-32b"), QWEN3),
    **dict.fromkeys(("qwen3-30b-a3b", "qwen3-30b-a3b-base", "qwen3-235b-a22b", "qwen3-coder-480b-a35b"), QWEN3_MOE),
    **dict.fromkeys(("mixtral-8x7b", "mixtral-8x22b"), MIXTRAL),
    "deepseek2-16b": DEEPSEEK2,
    "deepseek3-671b": DEEPSEEK3,
    "deepseek3.2-671b": DEEPSEEK32,
    **dict.fromkeys(("gpt-oss-20b", "gpt-oss-120b"), GPT_OSS),
    **dict.fromkeys(("gemma2-2b", "gemma2-9b", "gemma2-27b"), GEMMA2),
    **dict.fromkeys(("gemma3-4b", "gemma3-12b", "gemma3-27b"), GEMMA3),
    "gemma4-26b": GEMMA4_MOE,
    "gemma4-31b": GEMMA4_DENSE,
    "gemma4-e2b": GEMMA4_E2B,
    "gemma4-e4b": GEMMA4_E4B,
    **dict.fromkeys(("olmo3-7b", "olmo3-7b-pt", "olmo3-32b"), OLMO3),
    "qwen3-next-80b-a3b": QWEN3_NEXT,
    **dict.fromkeys(("qwen3.5-35b-a3b", "qwen3.5-397b-a17b"), QWEN3_5),
    **dict.fromkeys(("qwen3.5-35b-a3b-fp8", "qwen3.5-35b-fp8", "qwen3.5-397b-a17b-fp8"), QWEN3_5_FP8),
}
# The MaxText fields the tables' hooks and shapes use (as ``mt_<field>``); the MoE ones only for MoE tables.
DIMENSIONS = ("emb_dim", "num_query_heads", "num_kv_heads", "head_dim", "mlp_dim", "num_decoder_layers", "vocab_size")
MOE_DIMENSIONS = ("num_experts", "moe_mlp_dim")


def field(config: Any, name: str) -> Any:
    """A MaxText config field: an attribute (MaxText's ``HyperParameters``) or a mapping key."""
    value = config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)
    if value is None:
        raise ConfigError(name, None, "missing: otfload.maxtext needs it to choose and resolve a table", SOURCE)
    return value


def _int(config: Any, name: str, minimum: int = 1) -> int:
    value = field(config, name)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, value, f"must be an integer >= {minimum}", SOURCE)
    return value


@dataclass(frozen=True)
class Selection:
    """The table a MaxText config chose, its layout, and the fields its hooks resolve against."""

    model_name: str
    table: ModelTable
    scan_layers: bool
    param_scan_axis: int
    fields: dict[str, int]
    logits_via_embedding: bool

    @property
    def mapping(self) -> MappingTable:
        return self.table.mapping(self.scan_layers, self.hook_config({}))

    @property
    def groups(self) -> tuple[LayerGroup, ...]:
        return self.table.layer_groups(self.scan_layers)

    def hook_config(self, hf: Mapping[str, int | float]) -> dict[str, int | float]:
        """What the table's hooks and stack positions resolve against: the MaxText fields as
        ``mt_<field>``, ``param_scan_axis``, and the checkpoint's own fields ``hf`` (``hf_vocab_size``
        and the table's ``hf_fields``: :func:`check_checkpoint`)."""
        return {**{f"mt_{k}": v for k, v in self.fields.items()}, "param_scan_axis": self.param_scan_axis, **hf}

    def describe(self) -> str:
        layout = f"scanned, param_scan_axis {self.param_scan_axis}" if self.scan_layers else "unscanned"
        return f"otfload.maxtext table {self.table.name!r} ({layout})"


def select(config: Any) -> Selection:
    """The table and layout ``config`` (MaxText's) names; a model otfload has no table for is a
    :class:`ConfigError` on ``model_name`` listing those it has."""
    name = field(config, "model_name")
    key = name.replace("-Instruct", "") if isinstance(name, str) else name
    if key not in TABLES:
        raise ConfigError("model_name", name, f"otfload.maxtext has no table for it; tables: {sorted(TABLES)}", SOURCE)
    table = TABLES[key]
    scan = field(config, "scan_layers")
    if not isinstance(scan, bool):
        raise ConfigError("scan_layers", scan, "must be true or false", SOURCE)
    if not scan and table.unscanned == ():  # no groups for an unscanned tree: it has no table
        raise ConfigError("scan_layers", scan, f"otfload.maxtext table {table.name!r} maps scanned trees only",
                          SOURCE)
    if scan and not table.groups:  # MaxText builds the model unscanned only (Gemma 4 E2B/E4B)
        raise ConfigError("scan_layers", scan, f"otfload.maxtext table {table.name!r} maps unscanned trees only",
                          SOURCE)
    axis = _int(config, "param_scan_axis", minimum=0) if scan else 0
    names = DIMENSIONS + (MOE_DIMENSIONS if table.moe else ()) + table.fields + tuple(table.fixed)
    fields = {n: _int(config, n) for n in names}
    for name, value in table.fixed.items():
        if fields[name] != value:
            raise ConfigError(name, fields[name], f"otfload.maxtext table {table.name!r} is written for {value}",
                              SOURCE)
    for extra in table.extras:  # absent from a config: none (MaxText's default)
        count = _optional(config, extra.field, 0)
        if count not in (0, 1):
            raise ConfigError(extra.field, count, f"otfload.maxtext table {table.name!r} maps 0 or 1", SOURCE)
        fields[extra.field] = count
    for name in table.flags:
        flag = _optional(config, name, False)
        if not isinstance(flag, bool):
            raise ConfigError(name, flag, "must be true or false", SOURCE)
        fields[name] = int(flag)
    tied = bool(_optional(config, "logits_via_embedding", False))
    return Selection(key, table, scan, axis, fields, tied)


def _optional(config: Any, name: str, default: Any) -> Any:
    return config.get(name, default) if isinstance(config, Mapping) else getattr(config, name, default)


def check_checkpoint(selection: Selection, hf_config: Mapping[str, Any], location: str) -> dict[str, int | float]:
    """The checkpoint's fields the hooks read (``hf_vocab_size``, ``hf_<field>`` of the table's
    ``hf_fields``; a multimodal checkpoint's from its ``text_config``), once its ``config.json`` is
    one ``selection``'s table reads: a ``model_type`` of another model, or a vocabulary larger than
    MaxText's ``vocab_size``, is a :class:`ConfigError` on ``model_name`` / ``vocab_size``."""
    model_type = hf_config.get("model_type")
    if model_type not in selection.table.model_types:
        raise ConfigError("model_name", selection.model_name,
                          f"{selection.describe()} reads {sorted(selection.table.model_types)} checkpoints; "
                          f"{location} is model_type {model_type!r}", SOURCE)
    text = hf_config.get("text_config")
    text = text if isinstance(text, Mapping) else hf_config
    hf_vocab = text.get("vocab_size")
    if isinstance(hf_vocab, bool) or not isinstance(hf_vocab, int) or hf_vocab < 1:
        raise ConfigError("vocab_size", hf_vocab, "must be a positive integer", f"{location}/config.json")
    if hf_vocab > selection.fields["vocab_size"]:
        raise ConfigError("vocab_size", selection.fields["vocab_size"],
                          f"smaller than the checkpoint's vocab_size {hf_vocab} ({location}); MaxText pads the "
                          f"vocabulary, never cuts it ({selection.describe()})", SOURCE)
    values: dict[str, int | float] = {"hf_vocab_size": hf_vocab}
    for name in selection.table.hf_fields:
        value = text.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(name, value, f"must be a positive number: {selection.describe()} reads it",
                              f"{location}/config.json")
        values[f"hf_{name}"] = value
    return values


def _unscanned_regex(group: LayerGroup) -> re.Pattern[str]:
    head, _, tail = group.unscanned.partition("{layer}")
    return re.compile(rf"{re.escape(head)}(\d+){re.escape(tail)}\.")


def _layout_paths(table: ModelTable, leaves: Mapping[str, tuple[int, ...]], scan_layers: bool) -> list[str]:
    """The paths of ``leaves`` under a layer group of the scanned (or unscanned) tree of ``table``."""
    groups = table.layer_groups(scan_layers)
    if scan_layers:
        return sorted(p for p in leaves if any(p.startswith(g.scanned + ".") for g in groups))
    return sorted(p for p in leaves if any(_unscanned_regex(g).match(p) for g in groups))


def check_tree(selection: Selection, leaves: Mapping[str, tuple[int, ...]], hook_config: Mapping[str, Any]) -> None:
    """``leaves`` (dotted path → shape) are the tree ``selection`` describes: its layer layout,
    every leaf the table maps and none it does not, the layer axis at ``param_scan_axis`` and the
    embedding padded to ``vocab_size``; otherwise a :class:`ConfigError` naming the MaxText field."""
    where = selection.describe()
    other = _layout_paths(selection.table, leaves, not selection.scan_layers)
    if other:
        raise ConfigError("scan_layers", selection.scan_layers,
                          f"the abstract tree is laid out the other way ({other[0]!r}); {where}", SOURCE)
    table = selection.mapping
    unmapped = sorted(p for p in leaves if table.find(p) is None)
    missing = sorted(_expected(selection, hook_config) - set(leaves))
    if unmapped or missing:
        raise ConfigError("model_name", selection.model_name,
                          f"the abstract tree is not this model's: leaves {where} does not map {unmapped[:5]}, "
                          f"leaves it needs and the tree lacks {missing[:5]}", SOURCE)
    if selection.logits_via_embedding and LOGITS in leaves:
        raise ConfigError("logits_via_embedding", True, f"the abstract tree has {LOGITS!r}; {where}", SOURCE)
    if not selection.scan_layers:
        _check_layer_counts(selection, leaves, hook_config)
    embedding = leaves["token_embedder.embedding"]
    if embedding[0] != selection.fields["vocab_size"]:
        raise ConfigError("vocab_size", selection.fields["vocab_size"],
                          f"the abstract tree's token_embedder.embedding is {embedding}; {where}", SOURCE)
    if selection.scan_layers:
        _check_layer_axis(selection, leaves, hook_config)


def _count_field(group: LayerGroup) -> str:
    """The MaxText field a group's layer count is blamed on (its count expression's first field)."""
    return min(expressions.fields(group.count), key=group.count.index).removeprefix("mt_")


def _check_layer_counts(selection: Selection, leaves: Mapping[str, tuple[int, ...]],
                        hook_config: Mapping[str, Any]) -> None:
    """Each group of an unscanned tree has the layers its config says (``0 .. count-1``, or those of its ``at``)."""
    for group in selection.groups:
        regex, layers = _unscanned_regex(group), group.path_layers(hook_config)
        rules = group.rules(False, hook_config)  # by rule, not path: kinds of layers may share paths (Gemma 4)
        indices = {int(m.group(1)) for p in leaves if (m := regex.match(p)) and any(r.match(p) for r in rules)}
        if indices != set(layers):
            raise ConfigError(_count_field(group), selection.fields.get(_count_field(group)),
                              f"{group.unscanned} should be {len(layers)} layers; the abstract tree has "
                              f"{sorted(indices)[:3]}..{max(indices, default=-1)}; {selection.describe()}", SOURCE)


def _expected(selection: Selection, hook_config: Mapping[str, Any]) -> set[str]:
    """The leaf paths the tree must have (each unscanned group's first layer's)."""
    top = {leaf.path for leaf in selection.table.top}
    if selection.logits_via_embedding:
        top.discard(LOGITS)
    for group in selection.groups:
        if group.layers(hook_config) > 0:
            prefix = group.prefix(selection.scan_layers).replace("{layer}", str(group.path_layers(hook_config)[0]))
            top |= {f"{prefix}.{leaf.path}" for leaf in group.leaves}
    for extra in selection.table.extras:
        if selection.fields[extra.field]:
            top |= set(extra.paths())
    return top


def _check_layer_axis(selection: Selection, leaves: Mapping[str, tuple[int, ...]],
                      hook_config: Mapping[str, Any]) -> None:
    for group in selection.groups:
        rules = {rule.target: rule for rule in group.rules(scan_layers=True)}
        sizes = group.stack_sizes(hook_config)
        for path, shape in sorted(leaves.items()):
            rule = rules.get(path)
            found = None if rule is None else rule.match(path)
            if rule is None or found is None:
                continue
            axes = found[1]
            if len(shape) <= max(selection.param_scan_axis, len(axes) - 1):
                raise ConfigError("param_scan_axis", selection.param_scan_axis,
                                  f"leaf {path!r} {shape} has no such dimension; {selection.describe()}", SOURCE)
            for name, dim in zip(axes, stack_dims(rule, axes, len(shape), hook_config), strict=True):
                size = sizes[name] if name in sizes else hook_config[EXPERTS]
                if shape[dim] != size:
                    blame = "param_scan_axis" if name in sizes else "num_experts"
                    value = selection.param_scan_axis if name in sizes else size
                    raise ConfigError(blame, value,
                                      f"leaf {path!r} {shape}: its {name} axis at dimension {dim} has {shape[dim]}, "
                                      f"not {size}; {selection.describe()}", SOURCE)
