"""The mapping table of Gemma 2 and Gemma 3 (text): the Llama keys plus the pre/post feed-forward
norms. Tied checkpoints (``tie_word_embeddings`` defaults to true for Gemma; Gemma 3 writes no
``lm_head.weight``) build no ``lm_head`` leaf; an untied config without ``lm_head.weight`` is a
missing tensor.

Multimodal Gemma 3 checkpoints (``model_type`` ``gemma3``, e.g. ``gemma-3-4b-it``) load as their
text model (:mod:`otfload.families.multimodal`, registered in :mod:`otfload.families.gemma`): the
same table under the ``language_model.`` prefix; the vision tower and projector are never read and
are listed as unused tensors in the load report."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import LLAMA_STYLE_TABLE as LLAMA_TABLE
from otfload.families.gemma.config import GemmaConfig
from otfload.families.gqa_shape import attention_checks
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"

GEMMA_TABLE = MappingTable(
    rules=(
        Rule("layers.{layer}.pre_ffw_norm.scale", f"{L}.pre_feedforward_layernorm.weight"),
        Rule("layers.{layer}.post_ffw_norm.scale", f"{L}.post_feedforward_layernorm.weight"),
    ),
) + LLAMA_TABLE


def gemma_checks(cfg: GemmaConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Gemma's checks: the Llama attention checks (the field names are shared)."""
    return attention_checks(cfg)
