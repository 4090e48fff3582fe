"""Qwen3.5's text config (``qwen3_5_text``, ``qwen3_5_moe_text``; ``text_config`` of the multimodal
``qwen3_5`` / ``qwen3_5_moe``): ``config.json`` parsed and checked into a :class:`Qwen35Config`.

The fields and refusals shared with Qwen3-Next are :mod:`otfload.families.hybrid_config`'s: layers
are Gated DeltaNet or gated full attention by ``layer_types``, the two kinds groups of their own
shapes, whose HF layers are the config lists ``linear_layers`` and ``attention_layers`` the mapping
indexes by. Attention requires its output gate (``attn_output_gate``); the multimodal RoPE's sections
all take the same position, which makes it plain RoPE. The MoE model types replace every layer's MLP
by routed experts (softmax, top k, renormalised) plus a shared expert gated by a sigmoid; dense layers
among them (``mlp_only_layers``) are refused by name. Whether the routed experts are stored fused
(``mlp.experts.gate_up_proj`` / ``down_proj``, the bfloat16 releases) or per expert (the FP8 releases,
transformers' ``save_pretrained``) is the checkpoint index's to say (:func:`experts_layout`).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from otfload.config import EXPERTS, INTERMEDIATE, Fields, Int, List
from otfload.config.layer_types import FULL
from otfload.errors import ConfigError
from otfload.families.hybrid_config import LINEAR, HybridConfig, hybrid_fields

MOE_TYPES = ("qwen3_5_moe_text",)
# The name every fused layer's gate and up projections end with (under any prefix).
FUSED_EXPERTS = ".mlp.experts.gate_up_proj"


@dataclass(frozen=True)
class Qwen35Config(HybridConfig):
    """A Qwen3.5 text config (:class:`~otfload.families.hybrid_config.HybridConfig`'s fields), and
    whether its checkpoint stores the routed experts fused."""

    fused_experts: bool = False

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Qwen35Config:
        """Parse and check ``config.json`` (absent fields take transformers' Qwen3.5 defaults)."""
        f = Fields(hf)
        common = hybrid_fields(f, "Qwen3.5")
        n, types = common["num_hidden_layers"], common["layer_types"]
        moe = common["model_type"] in MOE_TYPES
        experts = f.get("num_experts", EXPERTS, 256) if moe else 0
        if moe and f.get("mlp_only_layers", List(Int(0, n - 1)), ()):
            raise ConfigError(f.name("mlp_only_layers"), f.data["mlp_only_layers"],
                              "dense layers among Qwen3.5's MoE layers are not supported")
        return cls(
            **common,
            intermediate_size=0 if moe else f.get("intermediate_size", INTERMEDIATE, 12288),
            linear_layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
            attention_layers=tuple(i for i, t in enumerate(types) if t == FULL),
            num_experts=experts,
            num_experts_per_tok=f.get("num_experts_per_tok", Int(1, experts), 8) if moe else 0,
            moe_intermediate_size=f.get("moe_intermediate_size", INTERMEDIATE, 512) if moe else 0,
            shared_expert_intermediate_size=f.get("shared_expert_intermediate_size", INTERMEDIATE, 512) if moe else 0,
        )


def experts_layout(cfg: Qwen35Config, names: Collection[str]) -> Qwen35Config:
    """``cfg`` reading fused experts when the checkpoint's tensor ``names`` hold a fused
    ``gate_up_proj`` (:attr:`Family.layout <otfload.families.registry.Family.layout>`)."""
    fused = bool(cfg.num_experts) and any(name.endswith(FUSED_EXPERTS) for name in names)
    return replace(cfg, fused_experts=fused)
