"""Llama 4's mapping table and checks.

The two layer groups read their HF layers through the config's lists of them (``indices={"layer":
"dense_layers"}`` / ``"moe_layers"``), so they may interleave. Attention kernels keep HF's ``[out,
in]`` orientation, reshaped to heads (:func:`~otfload.families.gqa_rules.gqa_rules`; Llama 4 has no
learned q/k norm). The fused experts are kept in x out as stored: ``gate_up_proj [E, hidden, 2 *
inter]`` is split on its last axis into ``gate`` (the first ``intermediate_size``) and ``up``, and
``down_proj [E, inter, hidden]`` is read as is; the router is ``[E, hidden]``. The multimodal
``llama4`` checkpoints carry the same keys under ``language_model.`` (:mod:`otfload.families.
multimodal`); the vision tower and projector match no rule and are never read."""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import decoder_table, mlp_rules, norm_rules
from otfload.families.gqa_rules import gqa_rules
from otfload.families.gqa_shape import attention_checks
from otfload.families.llama4.config import Llama4Config
from otfload.plan.hooks import Slice
from otfload.plan.mapping import Rule

HF = "model.layers.{layer}"
FF = f"{HF}.feed_forward"


def layer_rules(group: str, *, moe: bool) -> list[Rule]:
    """The rules of one layer group (``dense_layers`` or ``moe_layers``)."""
    rule = partial(Rule, indices={"layer": group})
    g = f"{group}.{{layer}}"
    rules = [*norm_rules(g, HF, rule), *gqa_rules(f"{g}.attn", f"{HF}.self_attn", rule=rule)]
    if not moe:
        return rules + mlp_rules(f"{g}.mlp", FF, rule)
    return [
        *rules,
        rule(f"{g}.moe.router.kernel", f"{FF}.router.weight"),
        rule(f"{g}.moe.gate.kernel", f"{FF}.experts.gate_up_proj", (Slice(-1, 0, "intermediate_size"),)),
        rule(f"{g}.moe.up.kernel", f"{FF}.experts.gate_up_proj", (Slice(-1, "intermediate_size", None),)),
        rule(f"{g}.moe.down.kernel", f"{FF}.experts.down_proj"),
        *mlp_rules(f"{g}.moe.shared", f"{FF}.shared_expert", rule),
    ]


LLAMA4_TABLE = decoder_table(*layer_rules("dense_layers", moe=False), *layer_rules("moe_layers", moe=True))


def llama4_checks(cfg: Llama4Config, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer and expert counts, vocabulary, width and (kv) heads against the tensors."""
    moe = (Dim("num_local_experts", cfg.num_experts, f"{FF}.router.weight", 0),
           Dim("num_local_experts", cfg.num_experts, f"{FF}.experts.gate_up_proj", 0))
    return (*attention_checks(cfg), *(moe if cfg.moe_layers else ()))
