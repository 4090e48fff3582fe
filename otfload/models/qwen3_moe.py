"""Qwen3-MoE: a Qwen3 decoder (q/k RMSNorm) whose feed-forward is a sparse MoE on the layers that
``decoder_sparse_step``/``mlp_only_layers`` select and a dense SwiGLU MLP on the others."""

from __future__ import annotations

from otfload.models.llama import LlamaConfig
from otfload.models.moe import MoeConfig


def qwen3_moe_config(hf: dict) -> MoeConfig:
    """The :class:`MoeConfig` of a Qwen3-MoE ``config.json``: layer ``i`` is MoE unless it is in
    ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0`` (transformers' rule)."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    step, dense_only = hf.get("decoder_sparse_step", 1), set(hf.get("mlp_only_layers") or ())
    is_moe = [i not in dense_only and experts > 0 and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])]
    return MoeConfig.extend(
        LlamaConfig.from_hf(hf),
        qk_norm=True,
        num_experts=experts,
        experts_per_token=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["moe_intermediate_size"],
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        moe_layers=tuple(i for i, moe in enumerate(is_moe) if moe),
        dense_layers=tuple(i for i, moe in enumerate(is_moe) if not moe),
    )
