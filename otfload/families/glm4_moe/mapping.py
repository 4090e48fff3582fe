"""GLM-4.5 / GLM-4.6's mapping table and checks.

HF layers ``0 .. first_k_dense_replace - 1`` feed ``dense_layers`` and the rest ``moe_layers``,
whose rules carry ``offsets={"layer": "first_k_dense_replace"}``. Routed experts are per-expert HF
keys stacked on the ``experts`` axis by the ``{expert}`` placeholder; the router's
``e_score_correction_bias`` and the shared experts map as DeepSeek-V3's. The MTP layers
(``num_nextn_predict_layers``, stored as HF layers ``num_hidden_layers ..``) match no rule: they
are listed as unused and never read."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from otfload.config import Count, Dim
from otfload.families.glm4_moe.config import EXPERT_FIELDS, Glm4MoeConfig
from otfload.families.gqa_rules import gqa_rules
from otfload.families.gqa_shape import attention_checks
from otfload.plan.mapping import MappingTable, Rule

HF = "model.layers.{layer}"


def _mlp_rules(rule: Callable[..., Rule], target: str, source: str) -> list[Rule]:
    return [rule(f"{target}.{name}.kernel", f"{source}.{name}_proj.weight") for name in ("gate", "up", "down")]


def layer_rules(group: str, *, moe: bool) -> list[Rule]:
    """Rules for one layer group (``dense_layers`` or ``moe_layers``)."""
    rule = partial(Rule, offsets={"layer": "first_k_dense_replace"}) if moe else Rule
    g = f"{group}.{{layer}}"
    rules = [
        rule(f"{g}.input_norm.scale", f"{HF}.input_layernorm.weight"),
        rule(f"{g}.post_attn_norm.scale", f"{HF}.post_attention_layernorm.weight"),
        *gqa_rules(f"{g}.attn", f"{HF}.self_attn", rule=rule),
    ]
    if not moe:
        return rules + _mlp_rules(rule, f"{g}.mlp", f"{HF}.mlp")
    return [
        *rules,
        rule(f"{g}.moe.router.kernel", f"{HF}.mlp.gate.weight"),
        rule(f"{g}.moe.router.bias", f"{HF}.mlp.gate.e_score_correction_bias"),
        *_mlp_rules(rule, f"{g}.moe.experts", f"{HF}.mlp.experts.{{expert}}"),
        *_mlp_rules(rule, f"{g}.moe.shared", f"{HF}.mlp.shared_experts"),
    ]


GLM4_MOE_TABLE = MappingTable(
    rules=(
        Rule("embed.embedding", "model.embed_tokens.weight"),
        Rule("final_norm.scale", "model.norm.weight"),
        Rule("lm_head.kernel", "lm_head.weight"),
        *layer_rules("dense_layers", moe=False),
        *layer_rules("moe_layers", moe=True),
    ),
    ignore=(r".*\.rotary_emb\.inv_freq",),
)


def glm4_moe_checks(cfg: Glm4MoeConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer (plus MTP) and expert counts, vocabulary, width, (kv) heads and router rows."""
    experts = next((k for k in EXPERT_FIELDS if config.get(k) is not None), EXPERT_FIELDS[0])
    moe = (Count(experts, cfg.num_experts, "expert"), Dim(experts, cfg.num_experts, f"{HF}.mlp.gate.weight", 0))
    return (
        Count("num_hidden_layers", cfg.num_hidden_layers, "layer", extra=cfg.mtp_layers),
        *(check for check in attention_checks(cfg) if not isinstance(check, Count)),
        *(moe if cfg.num_moe_layers else ()),
    )
