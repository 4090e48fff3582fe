"""Kimi-Linear's mapping table and checks.

Each layer group (``kda_dense_layers``, ``kda_moe_layers``, ``mla_dense_layers``, ``mla_moe_layers``)
reads its HF layers through the config's list of them. Kernels keep HF's ``[out, in]`` orientation.
KDA layers read ``self_attn.{q,k,v}_proj``, ``{q,k,v}_conv1d``, ``f_a_proj``/``f_b_proj``,
``dt_bias``, ``A_log`` (as stored, ``[1, 1, heads, 1]``), ``b_proj``, ``g_a_proj``/``g_b_proj``,
``o_norm`` and ``o_proj`` as the releases store them (transformers fuses the convolutions and moves
the decay's tensors under ``forget_gate.`` only in memory); MLA layers read DeepSeek's attention
rules (:func:`otfload.families.mla.layer_rules`). MoE layers read ``block_sparse_moe.``: the
router (``gate.weight``, ``gate.e_score_correction_bias``), the experts per expert (``w1`` gate,
``w3`` up, ``w2`` down) and the shared experts. Dense MLPs are ``mlp.{gate,up,down}_proj`` in the
releases (written so by export) and ``block_sparse_moe.{gate,up,down}_proj`` as transformers'
``save_pretrained`` renames them (a fallback). Tied configs build no ``lm_head`` leaf. PEFT LoRA
adapters, which name transformers' runtime modules, are mapped by :data:`KIMI_LINEAR_LORA`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import decoder_table, mlp_rules, norm_rules
from otfload.families.kimi_linear.config import GROUPS, KimiLinearConfig
from otfload.families.lora import ExpertLayout
from otfload.families.mla import layer_rules
from otfload.plan.hooks import Hook
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"
ATTN = f"{L}.self_attn"
MOE = f"{L}.block_sparse_moe"
EXPERT_WEIGHTS = {"gate": "w1", "up": "w3", "down": "w2"}

# leaf under a KDA layer's ``kda`` <- HF key under ``self_attn``
KDA = {
    **{f"{x}.kernel": f"{x}_proj.weight" for x in ("q", "k", "v", "b", "f_a", "f_b", "g_a", "g_b", "o")},
    **{f"{x}_conv": f"{x}_conv1d.weight" for x in ("q", "k", "v")},
    "dt_bias": "dt_bias",
    "A_log": "A_log",
    "norm.scale": "o_norm.weight",
}


def _mla_rules(group: str) -> list[Rule]:
    """DeepSeek's MLA attention rules (no indexer), re-indexed by ``group``'s config list."""
    template = "dense_layers.{layer}."
    return [dataclasses.replace(r, target=f"{group}.{{layer}}." + r.target.removeprefix(template),
                                indices={"layer": group})
            for r in layer_rules("dense_layers", moe=False)
            if r.target.startswith(f"{template}attn.") and ".indexer." not in r.target]


def _group_rules(group: str, kda: bool, moe: bool) -> list[Rule]:
    g = f"{group}.{{layer}}"

    def rule(target: str, source: str, *hooks: Hook, fallbacks: tuple[str, ...] = ()) -> Rule:
        return Rule(target, source, hooks, fallbacks=fallbacks, indices={"layer": group})

    def dense(target: str, source: str) -> Rule:  # the releases' mlp., else save_pretrained's block_sparse_moe.
        return rule(target, source, fallbacks=(source.replace(".mlp.", ".block_sparse_moe."),))

    rules = norm_rules(g, L, rule)
    rules += [rule(f"{g}.kda.{leaf}", f"{ATTN}.{key}") for leaf, key in KDA.items()] if kda else _mla_rules(group)
    if not moe:
        return rules + mlp_rules(f"{g}.mlp", f"{L}.mlp", dense)
    return [*rules,
            rule(f"{g}.moe.router.kernel", f"{MOE}.gate.weight"),
            rule(f"{g}.moe.router.bias", f"{MOE}.gate.e_score_correction_bias"),
            *(rule(f"{g}.moe.experts.{n}.kernel", f"{MOE}.experts.{{expert}}.{w}.weight")
              for n, w in EXPERT_WEIGHTS.items()),
            *mlp_rules(f"{g}.moe.shared", f"{MOE}.shared_experts", rule)]


# PEFT adapters name transformers' runtime modules: the decay's projections under ``forget_gate.``, the
# feed-forwards under ``mlp.`` and the experts fused (``gate_up_proj`` of w1 and w3, ``down_proj`` of w2).
KIMI_LINEAR_LORA = ExpertLayout(renames=((".mlp.", ".block_sparse_moe."), (".self_attn.forget_gate.", ".self_attn.")),
                                fused=(("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",))))

KIMI_LINEAR_TABLE = decoder_table(*(r for group in GROUPS for r in _group_rules(*group)))


def kimi_linear_table(cfg: KimiLinearConfig) -> MappingTable:
    return KIMI_LINEAR_TABLE


def kimi_linear_checks(cfg: KimiLinearConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer and expert counts, vocabulary, width, the MLA heads and the KDA heads, head size and
    convolution taps (on each kind's first layer) against the tensors."""
    embed = "model.embed_tokens.weight"
    checks: list[Count | Dim] = [Count("num_hidden_layers", cfg.num_hidden_layers, "layer"),
                                 Dim("vocab_size", cfg.vocab_size, embed, 0),
                                 Dim("hidden_size", cfg.hidden_size, embed, 1)]
    mla = cfg.mla_dense_layers + cfg.mla_moe_layers
    if mla:
        checks.append(Dim("num_attention_heads", cfg.num_attention_heads, f"model.layers.{min(mla)}.self_attn.o_proj"
                          ".weight", 1, ("v_head_dim", cfg.v_head_dim)))
    kda = cfg.kda_dense_layers + cfg.kda_moe_layers
    if kda:
        at = f"model.layers.{min(kda)}.self_attn"
        checks += [Dim("linear_num_heads", cfg.linear_num_heads, f"{at}.b_proj.weight", 0),
                   Dim("linear_head_dim", cfg.linear_head_dim, f"{at}.f_a_proj.weight", 0),
                   Dim("linear_conv_kernel_dim", cfg.linear_conv_kernel_dim, f"{at}.q_conv1d.weight", 2)]
    if cfg.kda_moe_layers or cfg.mla_moe_layers:
        experts = next((k for k in ("num_experts", "num_local_experts") if config.get(k) is not None), "num_experts")
        first = min(cfg.kda_moe_layers + cfg.mla_moe_layers)
        checks += [Count(experts, cfg.num_experts, "expert"),
                   Dim(experts, cfg.num_experts, f"model.layers.{first}.block_sparse_moe.gate.weight", 0)]
    return tuple(checks)
