"""Qwen3-MoE's config: a Qwen3 decoder (q/k RMSNorm) whose feed-forward is a sparse MoE on the
layers that ``decoder_sparse_step``/``mlp_only_layers`` select and a dense SwiGLU MLP on the others."""

from __future__ import annotations

from typing import Any

from otfload.config import BOOL, INTERMEDIATE, LAYERS, Fields, Int, List
from otfload.config.fields import MAX_EXPERTS, MAX_LAYERS
from otfload.families.llama.config import LlamaConfig
from otfload.families.mixtral.config import MoeConfig, top_k

# transformers reads ``num_experts``; configs written as Mixtral-style use ``num_local_experts``.
EXPERT_FIELDS = ("num_experts", "num_local_experts")
# 0 experts is allowed: every layer is then dense.
NUM_EXPERTS = Int(0, MAX_EXPERTS)
LAYER_INDICES = List(Int(0, MAX_LAYERS - 1))


def qwen3_moe_config(hf: dict[str, Any]) -> MoeConfig:
    """The :class:`MoeConfig` of a Qwen3-MoE ``config.json``: layer ``i`` is MoE unless it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (transformers' rule)."""
    base, f = LlamaConfig.from_hf(hf), Fields(hf)
    field, experts = f.first(EXPERT_FIELDS, NUM_EXPERTS)
    step = f.get("decoder_sparse_step", LAYERS, 1)
    dense_only = set(f.get("mlp_only_layers", LAYER_INDICES, ()))
    is_moe = [i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(base.num_hidden_layers)]
    return MoeConfig.extend(
        base,
        qk_norm=True,
        num_experts=experts,
        num_experts_per_tok=top_k(f, experts, field) if experts else f.get("num_experts_per_tok", NUM_EXPERTS, 0),
        moe_intermediate_size=f.get("moe_intermediate_size", INTERMEDIATE),
        norm_topk_prob=f.get("norm_topk_prob", BOOL, False),
        moe_layers=tuple(i for i, moe in enumerate(is_moe) if moe),
        dense_layers=tuple(i for i, moe in enumerate(is_moe) if not moe),
    )
