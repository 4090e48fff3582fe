"""Mixtral: a Mistral decoder whose every feed-forward is a sparse MoE (softmax router over
``num_local_experts``, top ``num_experts_per_tok`` renormalised, SwiGLU experts)."""

from __future__ import annotations

from typing import Any

from otfload.config import EXPERTS, WINDOW, Fields, require
from otfload.models.llama import LlamaConfig
from otfload.models.moe import MoeConfig


def top_k(f: Fields, experts: int, experts_field: str) -> int:
    """``num_experts_per_tok``, checked to pick no more experts than there are."""
    k: int = f.get("num_experts_per_tok", EXPERTS)
    require(k <= experts, f.name("num_experts_per_tok"), k, f"must be at most {experts_field} ({experts})")
    return k


def mixtral_config(hf: dict[str, Any]) -> MoeConfig:
    """The :class:`MoeConfig` of a Mixtral ``config.json``."""
    base, f = LlamaConfig.from_hf(hf), Fields(hf)
    experts = f.get("num_local_experts", EXPERTS)
    return MoeConfig.extend(
        base,
        sliding_window=f.nullable("sliding_window", WINDOW, None),
        num_experts=experts,
        experts_per_token=top_k(f, experts, "num_local_experts"),
        expert_intermediate_size=base.intermediate_size,
        norm_topk_prob=True,
        moe_layers=tuple(range(base.num_layers)),
    )
