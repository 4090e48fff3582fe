"""Mapping table for Mixtral: the Llama attention/norm/embedding keys plus the router and the
per-expert ``w1`` (gate), ``w3`` (up), ``w2`` (down) keys, each stacked on the experts axis."""

from __future__ import annotations

from otfload.families.llama import LLAMA_TABLE
from otfload.families.registry import Family, register
from otfload.models.mixtral import mixtral_config
from otfload.models.moe import MoeForCausalLM
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

MIXTRAL = register(
    Family(
        name="mixtral",
        model_types=("mixtral",),
        parse_config=mixtral_config,
        build=MoeForCausalLM,
        mapping=lambda cfg: MIXTRAL_TABLE,
    )
)
