"""Mapping table for Gemma 2 and Gemma 3 (text): the Llama keys plus the pre/post feed-forward
norms. Tied checkpoints (Gemma 3 writes no ``lm_head.weight``) use the Llama table's fallback."""

from __future__ import annotations

from otfload.families.llama import LLAMA_TABLE
from otfload.families.registry import Family, register
from otfload.models.gemma import GemmaConfig, GemmaForCausalLM
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"

GEMMA_TABLE = MappingTable(
    rules=(
        Rule("layers.{layer}.pre_ffw_norm.scale", f"{L}.pre_feedforward_layernorm.weight"),
        Rule("layers.{layer}.post_ffw_norm.scale", f"{L}.post_feedforward_layernorm.weight"),
    ),
) + LLAMA_TABLE

GEMMA = register(
    Family(
        name="gemma",
        model_types=("gemma2", "gemma3_text"),
        parse_config=GemmaConfig.from_hf,
        build=GemmaForCausalLM,
        mapping=lambda cfg: GEMMA_TABLE,
    )
)
