"""Mapping table for Gemma 2 and Gemma 3 (text): the Llama keys plus the pre/post feed-forward
norms. Tied checkpoints (``tie_word_embeddings`` defaults to true for Gemma; Gemma 3 writes no
``lm_head.weight``) build no ``lm_head`` leaf; an untied config without ``lm_head.weight`` is a
missing tensor.

Multimodal Gemma 3 checkpoints (``model_type`` ``gemma3``, e.g. ``gemma-3-4b-it``) load as their
text model: the same table under the ``language_model.`` prefix; the vision tower and projector are
never read and are listed as unused tensors in the load report."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from otfload.config import BOOL, Count, Dim, Fields
from otfload.config.fields import OBJECT
from otfload.families.llama import LLAMA_TABLE, attention_checks
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

# transformers writes (and the Hub holds) a multimodal Gemma 3's language model under these keys.
MULTIMODAL_PREFIXES = {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}
GEMMA3_MULTIMODAL_TABLE = GEMMA_TABLE.with_source_prefixes(MULTIMODAL_PREFIXES)


def text_config(hf: dict[str, Any]) -> GemmaConfig:
    """The language model's config of a multimodal ``gemma3`` checkpoint (``text_config``; the
    top-level ``tie_word_embeddings`` wins over the text config's, both default to true)."""
    f = Fields(hf)
    text = Fields(f.get("text_config", OBJECT), "text_config")
    tied = f.get("tie_word_embeddings", BOOL, None)
    tied = text.get("tie_word_embeddings", BOOL, True) if tied is None else tied
    return GemmaConfig.from_hf({**text.data, "model_type": "gemma3_text", "tie_word_embeddings": tied}, "text_config")


def _prefixed(check: Count | Dim) -> Count | Dim:
    """``check`` on the text config's field (counts already follow the table's prefixes)."""
    if isinstance(check, Count):
        return dataclasses.replace(check, field=f"text_config.{check.field}")
    old, new = next((o, n) for o, n in MULTIMODAL_PREFIXES.items() if check.tensor.startswith(o))
    return dataclasses.replace(check, field=f"text_config.{check.field}", tensor=new + check.tensor[len(old):])


def gemma_checks(cfg: GemmaConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    return attention_checks(cfg)


def multimodal_checks(cfg: GemmaConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """The text model's checks on the ``language_model.`` tensors (counts follow the table's prefix)."""
    return tuple(_prefixed(c) for c in attention_checks(cfg))


GEMMA3_MULTIMODAL = register(
    Family(
        name="gemma3 (text model of a multimodal checkpoint)",
        model_types=("gemma3",),
        parse_config=text_config,
        build=GemmaForCausalLM,
        mapping=lambda cfg: GEMMA3_MULTIMODAL_TABLE,
        checks=multimodal_checks,
    )
)

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
