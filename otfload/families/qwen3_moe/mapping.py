"""Qwen3-MoE's mapping table: the MoE layers form the ``layers`` group and the dense
(``mlp_only_layers`` / ``decoder_sparse_step``) ones the ``dense_layers`` group; every rule maps a
group position to its HF layer through the config's ``moe_layers`` / ``dense_layers`` lists, so
either group may be stacked even when the two interleave."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import LLAMA_STYLE_TABLE as LLAMA_TABLE
from otfload.families.gqa_shape import attention_checks
from otfload.families.mixtral.config import MoeConfig
from otfload.families.qwen3_moe.config import EXPERT_FIELDS
from otfload.plan.mapping import MappingTable, Rule

MOE = "model.layers.{layer}.mlp"


def is_layer_rule(rule: Rule) -> bool:
    return rule.target.startswith("layers.{layer}")


def in_group(table: MappingTable, group: str, indices: str) -> MappingTable:
    """``table``'s ``layers.{layer}...`` rules retargeted to ``group`` with HF layers from the config
    list ``indices``."""

    def retarget(rule: Rule) -> Rule:
        target = group + rule.target.removeprefix("layers")
        return dataclasses.replace(rule, target=target, indices={"layer": indices})

    return MappingTable(tuple(retarget(r) for r in table.rules if is_layer_rule(r)), table.ignore)


EXPERT_RULES = MappingTable(
    rules=(
        Rule("layers.{layer}.moe.router.kernel", f"{MOE}.gate.weight"),
        Rule("layers.{layer}.moe.gate.kernel", f"{MOE}.experts.{{expert}}.gate_proj.weight"),
        Rule("layers.{layer}.moe.up.kernel", f"{MOE}.experts.{{expert}}.up_proj.weight"),
        Rule("layers.{layer}.moe.down.kernel", f"{MOE}.experts.{{expert}}.down_proj.weight"),
    ),
)

# embeddings, final norm and lm_head: the Llama rules that are not per layer
GLOBAL_RULES = MappingTable(tuple(r for r in LLAMA_TABLE.rules if not is_layer_rule(r)), LLAMA_TABLE.ignore)

QWEN3_MOE_TABLE = (
    in_group(EXPERT_RULES + LLAMA_TABLE, "layers", "moe_layers")
    + in_group(LLAMA_TABLE, "dense_layers", "dense_layers")
    + GLOBAL_RULES
)


def qwen3_moe_checks(cfg: MoeConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """The Llama checks plus the expert count against expert indices and router rows."""
    field = next((k for k in EXPERT_FIELDS if config.get(k) is not None), EXPERT_FIELDS[0])
    # Without MoE layers (no experts, or every layer dense) no expert tensor is read, so none is counted.
    moe = (Count(field, cfg.num_experts, "expert"),) if cfg.moe_layers else ()
    return (
        *attention_checks(cfg),
        *moe,
        Dim(field, cfg.num_experts, f"{MOE}.gate.weight", 0),
    )
