"""Mapping table for Gemma 2 and Gemma 3 (text): the Llama keys plus the pre/post feed-forward
norms. Tied checkpoints (``tie_word_embeddings`` defaults to true for Gemma; Gemma 3 writes no
``lm_head.weight``) build no ``lm_head`` leaf; an untied config without ``lm_head.weight`` is a
missing tensor.

Multimodal Gemma 3 checkpoints (``model_type`` ``gemma3``, e.g. ``gemma-3-4b-it``) load as their
text model (:mod:`otfload.families.multimodal`): the same table under the ``language_model.``
prefix; the vision tower and projector are never read and are listed as unused tensors in the load
report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.llama import LLAMA_TABLE, attention_checks
from otfload.families.multimodal import text_model_family
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


def gemma_checks(cfg: GemmaConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    return attention_checks(cfg)


GEMMA = register(
    Family(
        name="gemma",
        model_types=("gemma2", "gemma3_text"),
        parse_config=GemmaConfig.from_hf,
        build=GemmaForCausalLM,
        mapping=lambda cfg: GEMMA_TABLE,
        checks=gemma_checks,
    )
)

GEMMA3_MULTIMODAL = register(
    text_model_family("gemma3 (text model of a multimodal checkpoint)", ("gemma3",), GEMMA, "gemma3_text")
)
