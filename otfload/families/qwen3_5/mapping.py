"""Qwen3.5's mapping tables and checks: :mod:`otfload.families.hybrid_rules`' groups (linear and
attention layers, through the config's ``linear_layers`` and ``attention_layers``), whose linear layers
read the projections as Qwen3.5 stores them: the fused ``in_proj_qkv`` as stored, ``in_proj_z`` by
value heads, ``in_proj_a`` and ``in_proj_b``. The multimodal checkpoints carry the same keys under
``model.language_model.`` (:mod:`otfload.families.multimodal`); the vision tower matches no rule and
is never read."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.hybrid_rules import Leaves, hybrid_checks, hybrid_table
from otfload.families.qwen3_5.config import Qwen35Config
from otfload.models.hybrid_decoder import LayerKind
from otfload.plan.hooks import Reshape
from otfload.plan.mapping import MappingTable

PROJECTIONS: Leaves = {
    "linear_attn.qkv.kernel": ("linear_attn.in_proj_qkv.weight", ()),
    "linear_attn.z.kernel": ("linear_attn.in_proj_z.weight",
                             (Reshape(("linear_num_value_heads", "linear_value_head_dim", "hidden_size")),)),
    "linear_attn.a.kernel": ("linear_attn.in_proj_a.weight", ()),
    "linear_attn.b.kernel": ("linear_attn.in_proj_b.weight", ()),
}


@functools.cache
def _table(kinds: tuple[LayerKind, ...]) -> MappingTable:
    return hybrid_table(kinds, PROJECTIONS)


def qwen3_5_table(cfg: Qwen35Config) -> MappingTable:
    """The table of ``cfg``'s model: MoE or dense feed-forwards."""
    return _table(cfg.layer_kinds())


def _projections(cfg: Qwen35Config, at: str) -> list[Dim]:
    hv = cfg.linear_num_value_heads
    return [Dim("linear_num_value_heads", hv, f"{at}.in_proj_a.weight", 0),
            Dim("linear_num_value_heads", hv, f"{at}.in_proj_z.weight", 0,
                ("linear_value_head_dim", cfg.linear_value_head_dim))]


def qwen3_5_checks(cfg: Qwen35Config, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """:func:`~otfload.families.hybrid_rules.hybrid_checks` with the value heads of ``in_proj_a`` and
    ``in_proj_z``."""
    return hybrid_checks(cfg, functools.partial(_projections, cfg))
