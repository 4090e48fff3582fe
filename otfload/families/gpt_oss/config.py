"""GPT-OSS's config: biased attention with per-head sinks, alternating sliding/full attention
(``layer_types``), YaRN RoPE, and a sparse MoE on every layer with a biased router (top k of the
logits, then softmax) and biased experts with GPT-OSS's clamped SwiGLU. The expert kernels keep the
checkpoint's ``[E, in, out]`` orientation (``experts_in_first``), so loading them is a copy."""

from __future__ import annotations

from typing import Any

from otfload.config import EXPERTS, POSITIVE, WINDOW, Fields
from otfload.config.layer_types import FULL, SLIDING, layer_types
from otfload.families.llama.config import LlamaConfig
from otfload.families.mixtral.config import MoeConfig, top_k
from otfload.models.moe import CLAMPED_SWIGLU, TOPK_SOFTMAX


def gpt_oss_config(hf: dict[str, Any]) -> MoeConfig:
    """The :class:`MoeConfig` of a GPT-OSS ``config.json``."""
    base, f = LlamaConfig.from_hf(hf), Fields(hf)
    n = base.num_hidden_layers
    types = layer_types(f, n, lambda: [SLIDING if (i + 1) % 2 else FULL for i in range(n)])
    experts = f.get("num_local_experts", EXPERTS)
    return MoeConfig.extend(
        base,
        sliding_window=f.nullable("sliding_window", WINDOW, None),
        sliding_layers=tuple(i for i, t in enumerate(types) if t == SLIDING),
        attention_sinks=True,
        num_experts=experts,
        num_experts_per_tok=top_k(f, experts, "num_local_experts"),
        moe_intermediate_size=base.intermediate_size,
        routing=TOPK_SOFTMAX,
        router_bias=True,
        expert_bias=True,
        activation=CLAMPED_SWIGLU,
        swiglu_alpha=f.get("swiglu_alpha", POSITIVE, 1.702),
        swiglu_limit=f.get("swiglu_limit", POSITIVE, 7.0),
        moe_layers=tuple(range(n)),
        experts_in_first=True,  # the fused expert tensors are stored [E, in, out]
    )
