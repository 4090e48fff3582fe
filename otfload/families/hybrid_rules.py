"""Mapping rules and checks that the Gated DeltaNet hybrids share (Qwen3.5, Qwen3-Next): each layer
kind (:class:`~otfload.models.hybrid_decoder.LayerKind`) is a group reading its HF layers through the
config's list of them, so the groups interleave as ``layer_types`` (and the dense layers) say.

Kernels keep HF's ``[out, in]`` orientation, reshaped to heads where the model has heads: ``q_proj``
as ``(heads, 2 * head_dim, hidden)`` (query and gate rows per head), ``out_proj`` by value heads;
the depthwise ``conv1d`` is read as stored. MoE layers read their experts per expert
(``mlp.experts.{expert}.*``, as transformers saves them), the shared expert and its one-row gate.
Tied configs build no ``lm_head`` leaf. A family adds its own linear-projection rules (how it fuses
them). The multi-token-prediction head (``mtp.*``) matches no rule and is never read."""

from __future__ import annotations

from collections.abc import Callable, Mapping

from otfload.config import Count, Dim
from otfload.config.layer_types import FULL
from otfload.families.decoder_rules import MODEL_RULES
from otfload.families.hybrid_config import LINEAR, HybridConfig
from otfload.models.hybrid_decoder import LayerKind
from otfload.plan.hooks import Hook, Reshape
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"
KV = ("num_key_value_heads", "head_dim", "hidden_size")
FFN = ("gate", "up", "down")
# leaf under a layer <- (HF key under model.layers.{layer}, hooks)
Leaves = Mapping[str, tuple[str, tuple[Hook, ...]]]

COMMON: Leaves = {
    "input_norm.scale": ("input_layernorm.weight", ()),
    "post_attn_norm.scale": ("post_attention_layernorm.weight", ()),
}
DENSE: Leaves = {f"mlp.{n}.kernel": (f"mlp.{n}_proj.weight", ()) for n in FFN}
MOE: Leaves = {
    "moe.router.kernel": ("mlp.gate.weight", ()),
    **{f"moe.{n}.kernel": (f"mlp.experts.{{expert}}.{n}_proj.weight", ()) for n in FFN},
    **{f"shared.{n}.kernel": (f"mlp.shared_expert.{n}_proj.weight", ()) for n in FFN},
    "shared_gate.kernel": ("mlp.shared_expert_gate.weight", ()),
}
# The linear layers' tensors every hybrid stores alike (a family adds its projections).
LINEAR_COMMON: Leaves = {
    "linear_attn.conv": ("linear_attn.conv1d.weight", ()),
    "linear_attn.dt_bias": ("linear_attn.dt_bias", ()),
    "linear_attn.A_log": ("linear_attn.A_log", ()),
    "linear_attn.norm.scale": ("linear_attn.norm.weight", ()),
    "linear_attn.out.kernel": ("linear_attn.out_proj.weight",
                               (Reshape(("hidden_size", "linear_num_value_heads", "linear_value_head_dim")),)),
}
ATTENTION: Leaves = {
    "attn.q.kernel": ("self_attn.q_proj.weight", (Reshape(("num_attention_heads", "2 * head_dim", "hidden_size")),)),
    "attn.k.kernel": ("self_attn.k_proj.weight", (Reshape(KV),)),
    "attn.v.kernel": ("self_attn.v_proj.weight", (Reshape(KV),)),
    "attn.o.kernel": ("self_attn.o_proj.weight", (Reshape(("hidden_size", "num_attention_heads", "head_dim")),)),
    "attn.q_norm.scale": ("self_attn.q_norm.weight", ()),
    "attn.k_norm.scale": ("self_attn.k_norm.weight", ()),
}


def group_rules(group: str, leaves: Leaves) -> list[Rule]:
    """One layer group's rules, its HF layers from the config list named ``group``."""
    return [Rule(f"{group}.{{layer}}.{leaf}", f"{L}.{key}", hooks, indices={"layer": group})
            for leaf, (key, hooks) in leaves.items()]


def hybrid_table(kinds: tuple[LayerKind, ...], projections: Leaves, common: Leaves = LINEAR_COMMON) -> MappingTable:
    """The table of a model of these layer kinds whose linear layers store their projections as
    ``projections`` says (and their other tensors as ``common``)."""
    rules = [*MODEL_RULES]
    for kind in kinds:
        mixer = {**common, **projections} if kind.linear else ATTENTION
        rules += group_rules(kind.group, {**COMMON, **mixer, **(MOE if kind.moe else DENSE)})
    return MappingTable(tuple(rules))


def hybrid_checks(cfg: HybridConfig, projections: Callable[[str], list[Dim]]) -> tuple[Count | Dim, ...]:
    """Layer count, vocabulary, width, the attention heads (on the first attention layer), the linear
    layers' projections (``projections(HF prefix of the first linear layer)``) and conv taps, and the
    expert count against the tensors."""
    embed = "model.embed_tokens.weight"
    checks: list[Count | Dim] = [Count("num_hidden_layers", cfg.num_hidden_layers, "layer"),
                                 Dim("vocab_size", cfg.vocab_size, embed, 0),
                                 Dim("hidden_size", cfg.hidden_size, embed, 1)]
    if FULL in cfg.layer_types:
        at = f"model.layers.{cfg.layer_types.index(FULL)}.self_attn"
        d = ("head_dim", cfg.head_dim)
        checks += [Dim("num_attention_heads", cfg.num_attention_heads, f"{at}.q_proj.weight", 0,
                       ("2 * head_dim", 2 * cfg.head_dim)),
                   Dim("num_key_value_heads", cfg.num_key_value_heads, f"{at}.k_proj.weight", 0, d)]
    if LINEAR in cfg.layer_types:
        at = f"model.layers.{cfg.layer_types.index(LINEAR)}.linear_attn"
        checks += [*projections(at),
                   Dim("linear_conv_kernel_dim", cfg.linear_conv_kernel_dim, f"{at}.conv1d.weight", 2)]
    if cfg.num_experts:
        checks += [Count("num_experts", cfg.num_experts, "expert"),
                   Dim("num_experts", cfg.num_experts, f"{L}.mlp.gate.weight", 0)]
    return tuple(checks)
