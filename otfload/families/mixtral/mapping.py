"""Mixtral's mapping table: the Llama attention/norm/embedding keys plus the router and the
per-expert ``w1`` (gate), ``w3`` (up), ``w2`` (down) keys, each stacked on the experts axis; and
its LoRA layout: transformers 5 renames ``block_sparse_moe`` to ``mlp`` and fuses ``w1|w3`` into
``experts.gate_up_proj`` (``w2`` into ``down_proj``), the names adapters trained there use."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import LLAMA_STYLE_TABLE as LLAMA_TABLE
from otfload.families.gqa_shape import attention_checks
from otfload.families.lora import ExpertLayout
from otfload.families.mixtral.config import MoeConfig
from otfload.plan.mapping import MappingTable, Rule

MOE = "model.layers.{layer}.block_sparse_moe"

MIXTRAL_TABLE = MappingTable(
    rules=(
        Rule("layers.{layer}.moe.router.kernel", f"{MOE}.gate.weight"),
        Rule("layers.{layer}.moe.gate.kernel", f"{MOE}.experts.{{expert}}.w1.weight"),
        Rule("layers.{layer}.moe.up.kernel", f"{MOE}.experts.{{expert}}.w3.weight"),
        Rule("layers.{layer}.moe.down.kernel", f"{MOE}.experts.{{expert}}.w2.weight"),
    ),
) + LLAMA_TABLE

MIXTRAL_LORA = ExpertLayout(renames=((".mlp.", ".block_sparse_moe."),),
                            fused=(("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))))


def mixtral_checks(cfg: MoeConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """The Llama checks plus the expert count against expert indices and router rows."""
    return (
        *attention_checks(cfg),
        Count("num_local_experts", cfg.num_experts, "expert"),
        Dim("num_local_experts", cfg.num_experts, f"{MOE}.gate.weight", 0),
    )
