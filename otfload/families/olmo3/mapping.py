"""OLMo 3's mapping table and checks: the Llama-style keys with OLMo's two post-norms and its q/k
norms over whole projections (:mod:`otfload.families.gqa_rules`). Tied configs build no ``lm_head``
leaf; an untied one without ``lm_head.weight`` is a missing tensor."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import decoder_table, mlp_rules
from otfload.families.gqa_rules import gqa_rules
from otfload.families.gqa_shape import attention_checks
from otfload.families.olmo3.config import Olmo3Config
from otfload.models.gqa import WHOLE
from otfload.plan.mapping import Rule

L = "model.layers.{layer}"

OLMO3_TABLE = decoder_table(
    Rule("layers.{layer}.post_attn_norm.scale", f"{L}.post_attention_layernorm.weight"),
    Rule("layers.{layer}.post_ffw_norm.scale", f"{L}.post_feedforward_layernorm.weight"),
    *gqa_rules("layers.{layer}.attn", f"{L}.self_attn", WHOLE),
    *mlp_rules("layers.{layer}.mlp", f"{L}.mlp"),
)


def olmo3_checks(cfg: Olmo3Config, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer count, vocabulary, width and (kv) heads against the tensors (the Llama-style checks)."""
    return attention_checks(cfg)
