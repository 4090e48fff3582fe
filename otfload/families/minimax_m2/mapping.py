"""MiniMax-M2's mapping table and checks: Llama-style attention keys with q/k norms over whole
projections (:mod:`otfload.families.gqa_rules`); each layer's ``block_sparse_moe``: router
``gate.weight``, ``e_score_correction_bias``, and per-expert ``w1``/``w3``/``w2`` (gate/up/down)
stacked on the ``experts`` axis by the ``{expert}`` placeholder. The MTP modules match no rule: they
are listed as unused and never read. FP8 block-scaled weights (``quantization_config``) decode on
read, or stay packed with ``quantized="keep"``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import decoder_table, norm_rules
from otfload.families.gqa_rules import gqa_rules
from otfload.families.gqa_shape import attention_checks
from otfload.families.minimax_m2.config import MiniMaxM2Config
from otfload.models.gqa import WHOLE
from otfload.plan.mapping import Rule

L = "model.layers.{layer}"
MOE = f"{L}.block_sparse_moe"
EXPERT = f"{MOE}.experts.{{expert}}"

MINIMAX_M2_TABLE = decoder_table(
    *norm_rules("layers.{layer}", L),
    *gqa_rules("layers.{layer}.attn", f"{L}.self_attn", WHOLE),
    Rule("layers.{layer}.moe.router.kernel", f"{MOE}.gate.weight"),
    Rule("layers.{layer}.moe.router.bias", f"{MOE}.e_score_correction_bias"),
    Rule("layers.{layer}.moe.experts.gate.kernel", f"{EXPERT}.w1.weight"),
    Rule("layers.{layer}.moe.experts.up.kernel", f"{EXPERT}.w3.weight"),
    Rule("layers.{layer}.moe.experts.down.kernel", f"{EXPERT}.w2.weight"),
)


def minimax_m2_checks(cfg: MiniMaxM2Config, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """The Llama-style checks plus the expert count against expert indices and router rows."""
    return (
        *attention_checks(cfg),
        Count("num_local_experts", cfg.num_experts, "expert"),
        Dim("num_local_experts", cfg.num_experts, f"{MOE}.gate.weight", 0),
    )
