"""Qwen3.5's mapping tables and checks: :mod:`otfload.families.hybrid_rules`' groups (linear and
attention layers, through the config's ``linear_layers`` and ``attention_layers``), whose linear layers
read the projections as Qwen3.5 stores them: the fused ``in_proj_qkv`` as stored, ``in_proj_z`` by
value heads, ``in_proj_a`` and ``in_proj_b``. The multimodal checkpoints carry the same keys under
``model.language_model.`` (:mod:`otfload.families.multimodal`); the vision tower matches no rule and
is never read. Routed experts are read as the checkpoint stores them (:attr:`Qwen35Config.fused_experts`,
from its index): per expert, or fused as the bfloat16 releases, ``gate_up_proj [E, 2 * inter, hidden]``
split on its output axis into the ``gate`` (first half) and ``up`` leaves and ``down_proj [E, hidden,
inter]`` as stored; a device reads only its experts' rows either way, and export writes the layout of
its reference checkpoint."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.hybrid_rules import L, Leaves, hybrid_checks, hybrid_table
from otfload.families.qwen3_5.config import Qwen35Config
from otfload.models.hybrid_decoder import LayerKind
from otfload.plan.hooks import Reshape, Slice
from otfload.plan.mapping import MappingTable, Rule

PROJECTIONS: Leaves = {
    "linear_attn.qkv.kernel": ("linear_attn.in_proj_qkv.weight", ()),
    "linear_attn.z.kernel": ("linear_attn.in_proj_z.weight",
                             (Reshape(("linear_num_value_heads", "linear_value_head_dim", "hidden_size")),)),
    "linear_attn.a.kernel": ("linear_attn.in_proj_a.weight", ()),
    "linear_attn.b.kernel": ("linear_attn.in_proj_b.weight", ()),
}

GATE_UP = f"{L}.mlp.experts.gate_up_proj"
# The routed experts' leaves when the checkpoint fuses them: leaf under a layer <- (HF key, hooks).
FUSED: Mapping[str, tuple[str, tuple[Slice, ...]]] = {
    "moe.gate.kernel": (GATE_UP, (Slice(1, 0, "moe_intermediate_size"),)),
    "moe.up.kernel": (GATE_UP, (Slice(1, "moe_intermediate_size"),)),
    "moe.down.kernel": (f"{L}.mlp.experts.down_proj", ()),
}


def _fused(rule: Rule) -> Rule:
    """``rule`` reading the fused experts' tensor when it is a routed expert's (else ``rule``)."""
    key, hooks = FUSED.get(rule.target.partition(".{layer}.")[2], (None, ()))
    return rule if key is None else dataclasses.replace(rule, source=key, hooks=hooks)


@functools.cache
def _table(kinds: tuple[LayerKind, ...], fused: bool) -> MappingTable:
    table = hybrid_table(kinds, PROJECTIONS)
    return MappingTable(tuple(map(_fused, table.rules)), table.ignore) if fused else table


def qwen3_5_table(cfg: Qwen35Config) -> MappingTable:
    """The table of ``cfg``'s model: dense feed-forwards, or experts per expert or fused."""
    return _table(cfg.layer_kinds(), cfg.fused_experts)


def _projections(cfg: Qwen35Config, at: str) -> list[Dim]:
    hv = cfg.linear_num_value_heads
    return [Dim("linear_num_value_heads", hv, f"{at}.in_proj_a.weight", 0),
            Dim("linear_num_value_heads", hv, f"{at}.in_proj_z.weight", 0,
                ("linear_value_head_dim", cfg.linear_value_head_dim))]


def qwen3_5_checks(cfg: Qwen35Config, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """:func:`~otfload.families.hybrid_rules.hybrid_checks` with the value heads of ``in_proj_a`` and
    ``in_proj_z``; fused experts are counted on ``gate_up_proj``'s first axis (no per-expert names)."""
    checks = hybrid_checks(cfg, functools.partial(_projections, cfg))
    if not cfg.fused_experts:
        return checks
    return (*(c for c in checks if not (isinstance(c, Count) and c.placeholder == "expert")),
            Dim("num_experts", cfg.num_experts, GATE_UP, 0),
            Dim("moe_intermediate_size", cfg.moe_intermediate_size, GATE_UP, 1, ("gate and up", 2)))
