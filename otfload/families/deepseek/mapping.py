"""The mapping table of DeepSeek-V2 and DeepSeek-V3 (``deepseek_v2``, ``deepseek_v3``) and their checks.

HF layers ``0 .. first_k_dense_replace - 1`` feed ``dense_layers`` and the rest ``moe_layers``,
whose rules carry ``offsets={"layer": "first_k_dense_replace"}`` so the group's index ``i`` reads HF
layer ``first_k_dense_replace + i``. Every leaf keeps HF's ``[out, in]`` orientation, so no hook
transposes. Fused MLA projections are split on their (leading) output dim, so each leaf reads only
its contiguous rows: ``kv_a_proj_with_mqa`` → ``kv_a`` (latent) + ``k_rope``; ``kv_b_proj`` (per head
``[k_nope | v]``) → ``k_b`` + ``v_b``. Routed experts are per-expert HF keys stacked on the
``experts`` axis by the ``{expert}`` placeholder. The MTP layer of V3 checkpoints (HF index
``num_hidden_layers``) matches no rule: it is listed as unused and never read.

Kimi-K2 (``kimi_k2``) is the DeepSeek-V3 architecture under another name (its ``architectures`` say
``DeepseekV3ForCausalLM``): the same model and table. Kimi-K2.5 (``kimi_k25``) wraps a ``kimi_k2``
language model (``text_config``, tensors under ``language_model.``) with a vision tower, which is
never read (:mod:`otfload.families.multimodal`; both are registered in :mod:`otfload.families.deepseek`);
its ``text_config`` carries the ``quantization_config`` (int4 routed experts), which the index
honours there.

``lm_head.weight`` has no fallback: tied configs build no ``lm_head`` leaf, and an untied one whose
checkpoint lacks it is a missing tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from functools import partial
from typing import Any

from otfload.config import Count, Dim
from otfload.families.deepseek.config import EXPERT_FIELDS, DeepseekConfig
from otfload.plan.hooks import Reshape, Slice
from otfload.plan.mapping import MappingTable, Rule

HF = "model.layers.{layer}"
ATTN = f"{HF}.self_attn"
# kv_b_proj.weight [heads * (nope + v), kv_lora] viewed as [heads, nope + v, kv_lora].
KV_B_HEADS = Reshape(("num_attention_heads", -1, "kv_lora_rank"))


def _mlp_rules(rule: Callable[..., Rule], target: str, source: str) -> list[Rule]:
    return [rule(f"{target}.{name}.kernel", f"{source}.{name}_proj.weight") for name in ("gate", "up", "down")]


def layer_rules(group: str, *, moe: bool) -> list[Rule]:
    """Rules for one layer group (``dense_layers`` or ``moe_layers``)."""
    rule = partial(Rule, offsets={"layer": "first_k_dense_replace"}) if moe else Rule
    g = f"{group}.{{layer}}"
    rules = [
        rule(f"{g}.input_norm.scale", f"{HF}.input_layernorm.weight"),
        rule(f"{g}.post_attn_norm.scale", f"{HF}.post_attention_layernorm.weight"),
        rule(f"{g}.attn.q.kernel", f"{ATTN}.q_proj.weight", (Reshape(("num_attention_heads", -1, "hidden_size")),)),
        rule(f"{g}.attn.q_a.kernel", f"{ATTN}.q_a_proj.weight"),
        rule(f"{g}.attn.q_a_norm.scale", f"{ATTN}.q_a_layernorm.weight"),
        rule(f"{g}.attn.q_b.kernel", f"{ATTN}.q_b_proj.weight", (Reshape(("num_attention_heads", -1, "q_lora_rank")),)),
        rule(f"{g}.attn.kv_a.kernel", f"{ATTN}.kv_a_proj_with_mqa.weight", (Slice(0, 0, "kv_lora_rank"),)),
        rule(f"{g}.attn.k_rope.kernel", f"{ATTN}.kv_a_proj_with_mqa.weight", (Slice(0, "kv_lora_rank"),)),
        rule(f"{g}.attn.kv_a_norm.scale", f"{ATTN}.kv_a_layernorm.weight"),
        rule(f"{g}.attn.k_b.kernel", f"{ATTN}.kv_b_proj.weight", (KV_B_HEADS, Slice(1, 0, "qk_nope_head_dim"))),
        rule(f"{g}.attn.v_b.kernel", f"{ATTN}.kv_b_proj.weight", (KV_B_HEADS, Slice(1, "qk_nope_head_dim"))),
        rule(f"{g}.attn.o.kernel", f"{ATTN}.o_proj.weight",
             (Reshape(("hidden_size", "num_attention_heads", "v_head_dim")),)),
    ]
    if not moe:
        return rules + _mlp_rules(rule, f"{g}.mlp", f"{HF}.mlp")
    return [
        *rules,
        rule(f"{g}.moe.router.kernel", f"{HF}.mlp.gate.weight"),
        rule(f"{g}.moe.router.bias", f"{HF}.mlp.gate.e_score_correction_bias"),
        # {expert} is absent from the target: it becomes the experts stack axis (after layers).
        *_mlp_rules(rule, f"{g}.moe.experts", f"{HF}.mlp.experts.{{expert}}"),
        *_mlp_rules(rule, f"{g}.moe.shared", f"{HF}.mlp.shared_experts"),
    ]


DEEPSEEK_TABLE = MappingTable(
    rules=(
        Rule("embed.embedding", "model.embed_tokens.weight"),
        Rule("final_norm.scale", "model.norm.weight"),
        Rule("lm_head.kernel", "lm_head.weight"),
        *layer_rules("dense_layers", moe=False),
        *layer_rules("moe_layers", moe=True),
    ),
    ignore=(r".*\.rotary_emb\.inv_freq",),
)


def deepseek_checks(cfg: DeepseekConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """Layer (plus MTP) and expert counts, vocabulary, width, heads and router rows against the tensors."""
    experts = next((k for k in EXPERT_FIELDS if config.get(k) is not None), EXPERT_FIELDS[0])
    # Without MoE layers (every layer dense) no expert tensor is read, so none is counted.
    moe = (Count(experts, cfg.num_experts, "expert"),) if cfg.num_moe_layers else ()
    return (
        Count("num_hidden_layers", cfg.num_hidden_layers, "layer", extra=cfg.mtp_layers),
        *moe,
        Dim("vocab_size", cfg.vocab_size, "model.embed_tokens.weight", 0),
        Dim("hidden_size", cfg.hidden_size, "model.embed_tokens.weight", 1),
        Dim("num_attention_heads", cfg.num_attention_heads, f"{ATTN}.o_proj.weight", 1, ("v_head_dim", cfg.v_head_dim)),
        Dim(experts, cfg.num_experts, f"{HF}.mlp.gate.weight", 0),
    )
