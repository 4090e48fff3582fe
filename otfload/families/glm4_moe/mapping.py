"""GLM-4.5 / GLM-4.6's mapping table and checks.

HF layers ``0 .. first_k_dense_replace - 1`` feed ``dense_layers`` and the rest ``moe_layers``,
whose rules carry ``offsets={"layer": "first_k_dense_replace"}``. Routed experts are per-expert HF
keys stacked on the ``experts`` axis by the ``{expert}`` placeholder; the router's
``e_score_correction_bias`` and the shared experts map as DeepSeek-V3's. The MTP layers
(``num_nextn_predict_layers``, stored as HF layers ``num_hidden_layers ..``) match no rule: they
are listed as unused and never read."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import decoder_table, mlp_rules, norm_rules, routed_rules
from otfload.families.glm4_moe.config import EXPERT_FIELDS, Glm4MoeConfig
from otfload.families.gqa_rules import gqa_rules
from otfload.families.gqa_shape import attention_checks
from otfload.plan.mapping import Rule

HF = "model.layers.{layer}"


def layer_rules(group: str, *, moe: bool) -> list[Rule]:
    """Rules for one layer group (``dense_layers`` or ``moe_layers``)."""
    rule = partial(Rule, offsets={"layer": "first_k_dense_replace"}) if moe else Rule
    g = f"{group}.{{layer}}"
    ffn = routed_rules(f"{g}.moe", f"{HF}.mlp", rule) if moe else mlp_rules(f"{g}.mlp", f"{HF}.mlp", rule)
    return [*norm_rules(g, HF, rule), *gqa_rules(f"{g}.attn", f"{HF}.self_attn", rule=rule), *ffn]


GLM4_MOE_TABLE = decoder_table(*layer_rules("dense_layers", moe=False), *layer_rules("moe_layers", moe=True))


def glm4_moe_checks(cfg: Glm4MoeConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer (plus MTP) and expert counts, vocabulary, width, (kv) heads and router rows."""
    experts = next((k for k in EXPERT_FIELDS if config.get(k) is not None), EXPERT_FIELDS[0])
    moe = (Count(experts, cfg.num_experts, "expert"), Dim(experts, cfg.num_experts, f"{HF}.mlp.gate.weight", 0))
    return (
        Count("num_hidden_layers", cfg.num_hidden_layers, "layer", extra=cfg.mtp_layers),
        *(check for check in attention_checks(cfg) if not isinstance(check, Count)),
        *(moe if cfg.num_moe_layers else ()),
    )
