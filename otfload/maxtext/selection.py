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
from otfload.maxtext.llama import LLAMA31
from otfload.maxtext.mixtral import MIXTRAL
from otfload.maxtext.qwen2 import QWEN2
from otfload.maxtext.qwen3 import QWEN3, QWEN3_MOE
from otfload.maxtext.tables import LOGITS, SCANNED, STACK_SIZES, ModelTable
from otfload.plan.mapping import MappingTable, stack_dims

SOURCE = "MaxText config"
TABLES: dict[str, ModelTable] = {
    **dict.fromkeys(("llama3.1-8b", "llama3.1-70b", "llama3.1-405b"), LLAMA31),
    **dict.fromkeys(("qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-14b"), QWEN2),
    **dict.fromkeys(("qwen3-0.6b", "qwen3-1.7b", "qwen3-1.7b-base", "qwen3-4b", "qwen3-4b-base",
                     "qwen3-4b-thinking-2507", "qwen3-8b", "qwen3-8b-base", "qwen3-14b", "qwen3-14b-base",
                     "qwen3-32b"), QWEN3),
    **dict.fromkeys(("qwen3-30b-a3b", "qwen3-30b-a3b-base", "qwen3-235b-a22b", "qwen3-coder-480b-a35b"), QWEN3_MOE),
    **dict.fromkeys(("mixtral-8x7b", "mixtral-8x22b"), MIXTRAL),
}
# The MaxText fields the tables' hooks and shapes use (as ``mt_<field>``); the MoE ones only for MoE tables.
DIMENSIONS = ("emb_dim", "num_query_heads", "num_kv_heads", "head_dim", "mlp_dim", "num_decoder_layers", "vocab_size")
MOE_DIMENSIONS = ("num_experts", "moe_mlp_dim")
_UNSCANNED_LAYER = re.compile(r"decoder\.layers_(\d+)\.")


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
        return self.table.mapping(self.scan_layers)

    def hook_config(self, hf_vocab_size: int) -> dict[str, int]:
        """What the table's hooks and stack positions resolve against: the MaxText fields as
        ``mt_<field>``, ``param_scan_axis``, and the checkpoint's own ``hf_vocab_size``."""
        return {**{f"mt_{k}": v for k, v in self.fields.items()}, "param_scan_axis": self.param_scan_axis,
                "hf_vocab_size": hf_vocab_size}

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
    axis = _int(config, "param_scan_axis", minimum=0) if scan else 0
    names = DIMENSIONS + (MOE_DIMENSIONS if any("expert" in leaf.source for leaf in table.block) else ())
    fields = {n: _int(config, n) for n in names}
    tied = bool(config.get("logits_via_embedding", False) if isinstance(config, Mapping)
                else getattr(config, "logits_via_embedding", False))
    return Selection(key, table, scan, axis, fields, tied)


def check_checkpoint(selection: Selection, hf_config: Mapping[str, Any], location: str) -> int:
    """The checkpoint's vocabulary size, once its ``config.json`` is one ``selection``'s table reads:
    a ``model_type`` of another model, or a vocabulary larger than MaxText's ``vocab_size``, is a
    :class:`ConfigError` on ``model_name`` / ``vocab_size``."""
    model_type = hf_config.get("model_type")
    if model_type not in selection.table.model_types:
        raise ConfigError("model_name", selection.model_name,
                          f"{selection.describe()} reads {sorted(selection.table.model_types)} checkpoints; "
                          f"{location} is model_type {model_type!r}", SOURCE)
    hf_vocab = hf_config.get("vocab_size")
    if isinstance(hf_vocab, bool) or not isinstance(hf_vocab, int) or hf_vocab < 1:
        raise ConfigError("vocab_size", hf_vocab, "must be a positive integer", f"{location}/config.json")
    if hf_vocab > selection.fields["vocab_size"]:
        raise ConfigError("vocab_size", selection.fields["vocab_size"],
                          f"smaller than the checkpoint's vocab_size {hf_vocab} ({location}); MaxText pads the "
                          f"vocabulary, never cuts it ({selection.describe()})", SOURCE)
    return hf_vocab


def check_tree(selection: Selection, leaves: Mapping[str, tuple[int, ...]], hook_config: Mapping[str, Any]) -> None:
    """``leaves`` (dotted path → shape) are the tree ``selection`` describes: its layer layout,
    every leaf the table maps and none it does not, the layer axis at ``param_scan_axis`` and the
    embedding padded to ``vocab_size``; otherwise a :class:`ConfigError` naming the MaxText field."""
    where = selection.describe()
    unscanned = sorted(p for p in leaves if _UNSCANNED_LAYER.match(p))
    scanned = sorted(p for p in leaves if p.startswith(SCANNED + "."))
    if selection.scan_layers and unscanned or not selection.scan_layers and scanned:
        found = (unscanned or scanned)[0]
        raise ConfigError("scan_layers", selection.scan_layers,
                          f"the abstract tree is laid out the other way ({found!r}); {where}", SOURCE)
    table = selection.mapping
    unmapped = sorted(p for p in leaves if table.find(p) is None)
    expected = _expected(selection)
    missing = sorted(expected - set(leaves))
    if unmapped or missing:
        raise ConfigError("model_name", selection.model_name,
                          f"the abstract tree is not this model's: leaves {where} does not map {unmapped[:5]}, "
                          f"leaves it needs and the tree lacks {missing[:5]}", SOURCE)
    if selection.logits_via_embedding and LOGITS in leaves:
        raise ConfigError("logits_via_embedding", True, f"the abstract tree has {LOGITS!r}; {where}", SOURCE)
    layers = selection.fields["num_decoder_layers"]
    indices = {int(m.group(1)) for p in unscanned if (m := _UNSCANNED_LAYER.match(p))}
    if not selection.scan_layers and indices != set(range(layers)):
        raise ConfigError("num_decoder_layers", layers,
                          f"the abstract tree has layers {sorted(indices)[:3]}..{max(indices, default=-1)}; {where}",
                          SOURCE)
    embedding = leaves["token_embedder.embedding"]
    if embedding[0] != selection.fields["vocab_size"]:
        raise ConfigError("vocab_size", selection.fields["vocab_size"],
                          f"the abstract tree's token_embedder.embedding is {embedding}; {where}", SOURCE)
    if selection.scan_layers:
        _check_layer_axis(selection, table, leaves, hook_config)


def _expected(selection: Selection) -> set[str]:
    """The leaf paths the tree must have (the first layer's, unscanned)."""
    prefix = SCANNED if selection.scan_layers else "decoder.layers_0"
    top = {leaf.path for leaf in selection.table.top}
    if selection.logits_via_embedding:
        top.discard(LOGITS)
    return top | {f"{prefix}.{leaf.path}" for leaf in selection.table.block}


def _check_layer_axis(selection: Selection, table: MappingTable, leaves: Mapping[str, tuple[int, ...]],
                      hook_config: Mapping[str, Any]) -> None:
    for path, shape in sorted(leaves.items()):
        found = table.find(path)
        if found is None or not found[2]:
            continue
        rule, _, axes = found
        if len(shape) <= max(selection.param_scan_axis, len(axes) - 1):
            raise ConfigError("param_scan_axis", selection.param_scan_axis,
                              f"leaf {path!r} {shape} has no such dimension; {selection.describe()}", SOURCE)
        for name, dim in zip(axes, stack_dims(rule, axes, len(shape), hook_config), strict=True):
            size = hook_config[f"{STACK_SIZES[name]}"]
            if shape[dim] != size:
                blame = "param_scan_axis" if name == "layer" else "num_experts"
                value = selection.param_scan_axis if name == "layer" else size
                raise ConfigError(blame, value,
                                  f"leaf {path!r} {shape}: its {name} axis at dimension {dim} has {shape[dim]}, "
                                  f"not {size}; {selection.describe()}", SOURCE)
