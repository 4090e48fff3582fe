"""Gemma 4's mapping table and checks.

Each layer group (:data:`~otfload.families.gemma4.config.GROUPS`) reads its HF layers through the
config's list of them (``indices={"layer": "sliding_layers"}``, ...), so the groups may interleave.
Every kernel keeps HF's ``[out, in]`` orientation: q/k/v/o are only reshaped to heads (with the
full layers' ``global_head_dim`` and kv heads), and the MoE block's fused ``experts.gate_up_proj
[E, 2 * inter, hidden]`` is split on its output axis into the ``gate`` (first half) and ``up``
leaves. The KV-shared layers' key/value projections and norms, which a checkpoint may hold and
transformers ignores, are ignored (:func:`gemma4_table`). Tied configs (the default) build no
``lm_head`` leaf; an untied one without ``lm_head.weight`` is a missing tensor. The multimodal
``gemma4`` checkpoints carry the same keys under ``model.language_model.``
(:mod:`otfload.families.multimodal`); their vision and audio towers match no rule and are never read."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.decoder_rules import MODEL_RULES
from otfload.families.gemma4.config import GROUPS, Gemma4Config
from otfload.plan.hooks import Reshape, Slice
from otfload.plan.mapping import MappingTable, Rule

L = "model.layers.{layer}"
A = f"{L}.self_attn"
# Layer parameters read as stored: leaf (under the group's layer) <- HF key (under model.layers.{layer}).
PLAIN = {
    "input_norm.scale": "input_layernorm.weight",
    "post_attn_norm.scale": "post_attention_layernorm.weight",
    "pre_ffw_norm.scale": "pre_feedforward_layernorm.weight",
    "post_ffw_norm.scale": "post_feedforward_layernorm.weight",
    "layer_scalar": "layer_scalar",
    "attn.q_norm.scale": "self_attn.q_norm.weight",
    "attn.k_norm.scale": "self_attn.k_norm.weight",
    **{f"mlp.{n}.kernel": f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")},
    "post_ffw_norm_1.scale": "post_feedforward_layernorm_1.weight",
    "pre_ffw_norm_2.scale": "pre_feedforward_layernorm_2.weight",
    "post_ffw_norm_2.scale": "post_feedforward_layernorm_2.weight",
    "moe.router.kernel": "router.proj.weight",
    "moe.router.scale": "router.scale",
    "moe.router.per_expert_scale": "router.per_expert_scale",
    "moe.down.kernel": "experts.down_proj",
    "ple_gate.kernel": "per_layer_input_gate.weight",
    "ple_proj.kernel": "per_layer_projection.weight",
    "ple_norm.scale": "post_per_layer_input_norm.weight",
}


def group_rules(group: str, full: bool) -> list[Rule]:
    """The rules of one layer group (its HF layers from the config list named ``group``)."""
    dim, kv = ("global_head_dim", "num_global_key_value_heads") if full else ("head_dim", "num_key_value_heads")
    shaped = {
        "attn.q.kernel": ("self_attn.q_proj.weight", (Reshape(("num_attention_heads", dim, "hidden_size")),)),
        "attn.k.kernel": ("self_attn.k_proj.weight", (Reshape((kv, dim, "hidden_size")),)),
        "attn.v.kernel": ("self_attn.v_proj.weight", (Reshape((kv, dim, "hidden_size")),)),
        "attn.o.kernel": ("self_attn.o_proj.weight", (Reshape(("hidden_size", "num_attention_heads", dim)),)),
        "moe.gate.kernel": ("experts.gate_up_proj", (Slice(1, 0, "moe_intermediate_size"),)),
        "moe.up.kernel": ("experts.gate_up_proj", (Slice(1, "moe_intermediate_size"),)),
        **{leaf: (key, ()) for leaf, key in PLAIN.items()},
    }
    return [Rule(f"{group}.{{layer}}.{leaf}", f"{L}.{key}", hooks, indices={"layer": group})
            for leaf, (key, hooks) in shaped.items()]


GEMMA4_TABLE = MappingTable(
    rules=(
        *MODEL_RULES,
        Rule("embed_per_layer.embedding", "model.embed_tokens_per_layer.weight"),
        Rule("ple_projection.kernel", "model.per_layer_model_projection.weight"),
        Rule("ple_projection_norm.scale", "model.per_layer_projection_norm.weight"),
        *(r for group, layer_type, _ in GROUPS for r in group_rules(group, layer_type == "full_attention")),
    ),
)


def gemma4_table(cfg: Gemma4Config) -> MappingTable:
    """:data:`GEMMA4_TABLE`, ignoring the key/value projections and norms a checkpoint may still hold
    for its KV-shared layers (transformers drops them on load: those layers compute none)."""
    shared = [i for i, source in enumerate(cfg.kv_source) if source != i]
    if not shared:
        return GEMMA4_TABLE
    layers = "|".join(map(str, shared))
    ignore = rf"(.*\.)?layers\.({layers})\.self_attn\.(k_proj|v_proj|k_norm|v_norm)\.weight"
    return MappingTable(GEMMA4_TABLE.rules, (*GEMMA4_TABLE.ignore, ignore))


def gemma4_checks(cfg: Gemma4Config, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer count, vocabulary, width and each layer type's heads against the tensors (the first
    layer of each group that computes keys and values)."""
    embed = "model.embed_tokens.weight"
    checks: list[Count | Dim] = [
        Count("num_hidden_layers", cfg.num_hidden_layers, "layer"),
        Dim("vocab_size", cfg.vocab_size, embed, 0),
        Dim("hidden_size", cfg.hidden_size, embed, 1),
    ]
    for layers, dim, kv in ((cfg.sliding_layers, ("head_dim", cfg.head_dim), "num_key_value_heads"),
                            (cfg.full_layers, ("global_head_dim", cfg.global_head_dim), "num_global_key_value_heads")):
        if layers:
            at = f"model.layers.{layers[0]}.self_attn"
            checks += [Dim("num_attention_heads", cfg.num_attention_heads, f"{at}.q_proj.weight", 0, dim),
                       Dim(kv, cfg.to_dict()[kv], f"{at}.k_proj.weight", 0, dim)]
    if cfg.num_experts:
        checks.append(Dim("num_experts", cfg.num_experts, f"{L}.router.proj.weight", 0))
    return tuple(checks)
