"""Mapping table for Gemma 2 and Gemma 3 (text): the Llama keys plus the pre/post feed-forward
norms. Tied checkpoints (Gemma 3 writes no ``lm_head.weight``) use the Llama table's fallback.

Multimodal Gemma 3 checkpoints (``model_type`` ``gemma3``, e.g. ``gemma-3-4b-it``) load as their
text model: the same table under the ``language_model.`` prefix; the vision tower and projector are
never read and are listed as unused tensors in the load report."""

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

# transformers writes (and the Hub holds) a multimodal Gemma 3's language model under these keys.
MULTIMODAL_PREFIXES = {"model.": "language_model.model.", "lm_head.": "language_model.lm_head."}
GEMMA3_MULTIMODAL_TABLE = GEMMA_TABLE.with_source_prefixes(MULTIMODAL_PREFIXES)


def text_config(hf: dict) -> GemmaConfig:
    """The language model's config of a multimodal ``gemma3`` checkpoint."""
    text = hf.get("text_config") or {}
    tied = hf.get("tie_word_embeddings", text.get("tie_word_embeddings", True))
    return GemmaConfig.from_hf({**text, "model_type": "gemma3_text", "tie_word_embeddings": tied})


GEMMA3_MULTIMODAL = register(
    Family(
        name="gemma3 (text model of a multimodal checkpoint)",
        model_types=("gemma3",),
        parse_config=text_config,
        build=GemmaForCausalLM,
        mapping=lambda cfg: GEMMA3_MULTIMODAL_TABLE,
    )
)

GEMMA = register(
    Family(
        name="gemma",
        model_types=("gemma2", "gemma3_text"),
        parse_config=GemmaConfig.from_hf,
        build=GemmaForCausalLM,
        mapping=lambda cfg: GEMMA_TABLE,
    )
)
