"""Qwen3.5's mapping tables and checks.

The linear and the attention layers are two groups (``linear_layers``, ``attention_layers``), each
reading its HF layers through the config's list of them, so the groups interleave as ``layer_types``
says. Kernels keep HF's ``[out, in]`` orientation, reshaped to heads where the model has heads:
``q_proj`` as ``(heads, 2 * head_dim, hidden)`` (query and gate rows per head), ``in_proj_z`` and
``out_proj`` by value heads; the fused ``in_proj_qkv`` and the depthwise ``conv1d`` are read as
stored. MoE layers read their experts per expert (``mlp.experts.{expert}.*``, as transformers saves
them), the shared expert and its one-row gate. Tied configs build no ``lm_head`` leaf. The
multimodal checkpoints carry the same keys under ``model.language_model.``
(:mod:`otfload.families.multimodal`); the vision tower and the multi-token-prediction head
(``mtp.*``) match no rule and are never read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import MODEL_RULES
from otfload.families.qwen3_5.config import Qwen35Config
from otfload.families.qwen3_5.model import ATTENTION_GROUP, LINEAR_GROUP
from otfload.plan.hooks import Hook, Reshape
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"
HEADS = ("num_attention_heads", "head_dim", "hidden_size")
KV = ("num_key_value_heads", "head_dim", "hidden_size")
V_HEADS = ("linear_num_value_heads", "linear_value_head_dim", "hidden_size")
FFN = ("gate", "up", "down")

# leaf under a layer <- (HF key under model.layers.{layer}, hooks)
COMMON: dict[str, tuple[str, tuple[Hook, ...]]] = {
    "input_norm.scale": ("input_layernorm.weight", ()),
    "post_attn_norm.scale": ("post_attention_layernorm.weight", ()),
}
DENSE = {f"mlp.{n}.kernel": (f"mlp.{n}_proj.weight", ()) for n in FFN}
MOE = {
    "moe.router.kernel": ("mlp.gate.weight", ()),
    **{f"moe.{n}.kernel": (f"mlp.experts.{{expert}}.{n}_proj.weight", ()) for n in FFN},
    **{f"shared.{n}.kernel": (f"mlp.shared_expert.{n}_proj.weight", ()) for n in FFN},
    "shared_gate.kernel": ("mlp.shared_expert_gate.weight", ()),
}
LINEAR = {
    "linear_attn.qkv.kernel": ("linear_attn.in_proj_qkv.weight", ()),
    "linear_attn.conv": ("linear_attn.conv1d.weight", ()),
    "linear_attn.z.kernel": ("linear_attn.in_proj_z.weight", (Reshape(V_HEADS),)),
    "linear_attn.a.kernel": ("linear_attn.in_proj_a.weight", ()),
    "linear_attn.b.kernel": ("linear_attn.in_proj_b.weight", ()),
    "linear_attn.dt_bias": ("linear_attn.dt_bias", ()),
    "linear_attn.A_log": ("linear_attn.A_log", ()),
    "linear_attn.norm.scale": ("linear_attn.norm.weight", ()),
    "linear_attn.out.kernel": ("linear_attn.out_proj.weight",
                               (Reshape(("hidden_size", "linear_num_value_heads", "linear_value_head_dim")),)),
}
ATTENTION = {
    "attn.q.kernel": ("self_attn.q_proj.weight", (Reshape(("num_attention_heads", "2 * head_dim", "hidden_size")),)),
    "attn.k.kernel": ("self_attn.k_proj.weight", (Reshape(KV),)),
    "attn.v.kernel": ("self_attn.v_proj.weight", (Reshape(KV),)),
    "attn.o.kernel": ("self_attn.o_proj.weight", (Reshape(("hidden_size", "num_attention_heads", "head_dim")),)),
    "attn.q_norm.scale": ("self_attn.q_norm.weight", ()),
    "attn.k_norm.scale": ("self_attn.k_norm.weight", ()),
}


def group_rules(group: str, leaves: Mapping[str, tuple[str, tuple[Hook, ...]]]) -> list[Rule]:
    """One layer group's rules, its HF layers from the config list named ``group``."""
    return [Rule(f"{group}.{{layer}}.{leaf}", f"{L}.{key}", hooks, indices={"layer": group})
            for leaf, (key, hooks) in leaves.items()]


def _table(ffn: Mapping[str, tuple[str, tuple[Hook, ...]]]) -> MappingTable:
    return MappingTable((*MODEL_RULES, *group_rules(LINEAR_GROUP, {**COMMON, **LINEAR, **ffn}),
                         *group_rules(ATTENTION_GROUP, {**COMMON, **ATTENTION, **ffn})))


DENSE_TABLE, MOE_TABLE = _table(DENSE), _table(MOE)


def qwen3_5_table(cfg: Qwen35Config) -> MappingTable:
    """The table of ``cfg``'s model: MoE or dense feed-forwards."""
    return MOE_TABLE if cfg.num_experts else DENSE_TABLE


def qwen3_5_checks(cfg: Qwen35Config, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer count, vocabulary, width, the attention and linear heads (on each kind's first layer) and
    the expert count against the tensors."""
    embed = "model.embed_tokens.weight"
    checks: list[Count | Dim] = [Count("num_hidden_layers", cfg.num_hidden_layers, "layer"),
                                 Dim("vocab_size", cfg.vocab_size, embed, 0),
                                 Dim("hidden_size", cfg.hidden_size, embed, 1)]
    if cfg.attention_layers:
        at = f"model.layers.{cfg.attention_layers[0]}.self_attn"
        d = ("head_dim", cfg.head_dim)
        checks += [Dim("num_attention_heads", cfg.num_attention_heads, f"{at}.q_proj.weight", 0,
                       ("2 * head_dim", 2 * cfg.head_dim)),
                   Dim("num_key_value_heads", cfg.num_key_value_heads, f"{at}.k_proj.weight", 0, d)]
    if cfg.linear_layers:
        at = f"model.layers.{cfg.linear_layers[0]}.linear_attn"
        checks += [Dim("linear_num_value_heads", cfg.linear_num_value_heads, f"{at}.in_proj_a.weight", 0),
                   Dim("linear_num_value_heads", cfg.linear_num_value_heads, f"{at}.in_proj_z.weight", 0,
                       ("linear_value_head_dim", cfg.linear_value_head_dim)),
                   Dim("linear_conv_kernel_dim", cfg.linear_conv_kernel_dim, f"{at}.conv1d.weight", 2)]
    if cfg.num_experts:
        checks += [Count("num_experts", cfg.num_experts, "expert"),
                   Dim("num_experts", cfg.num_experts, f"{L}.mlp.gate.weight", 0)]
    return tuple(checks)
