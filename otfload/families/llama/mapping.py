"""The Llama family's mapping table (Llama 3, Mistral, Qwen2, Qwen3) and the checks of a config
against the checkpoint's tensors; the MoE and Gemma tables extend them.

``lm_head.weight`` has no fallback: a tied model has no ``lm_head`` leaf, so an untied config
(``tie_word_embeddings`` false, transformers' default for these families) whose checkpoint lacks
``lm_head.weight`` is a missing tensor, never a silent copy of the embeddings."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import LLAMA_STYLE_TABLE
from otfload.families.gqa_shape import attention_checks
from otfload.families.llama.config import LlamaConfig

LLAMA_TABLE = LLAMA_STYLE_TABLE


def llama_checks(cfg: LlamaConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """The Llama family's checks: :func:`attention_checks` of the top-level model."""
    return attention_checks(cfg)
