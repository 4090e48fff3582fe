"""Mixtral: a Mistral decoder whose every feed-forward is a sparse MoE (softmax router over
``num_local_experts``, top ``num_experts_per_tok`` renormalised, SwiGLU experts)."""

from __future__ import annotations

from otfload.models.llama import LlamaConfig
from otfload.models.moe import MoeConfig


def mixtral_config(hf: dict) -> MoeConfig:
    """The :class:`MoeConfig` of a Mixtral ``config.json``."""
    layers = tuple(range(hf["num_hidden_layers"]))
    return MoeConfig.extend(
        LlamaConfig.from_hf(hf),
        sliding_window=hf.get("sliding_window"),
        num_experts=hf["num_local_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["intermediate_size"],
        norm_topk_prob=True,
        moe_layers=layers,
    )
