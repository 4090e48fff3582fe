"""GPT-OSS: biased attention with per-head sinks, alternating sliding/full attention
(``layer_types``), YaRN RoPE, and a sparse MoE on every layer with a biased router (top k of the
logits, then softmax) and biased experts with GPT-OSS's clamped SwiGLU. The expert kernels keep the
checkpoint's ``[E, in, out]`` orientation (``experts_in_first``), so loading them is a copy."""

from __future__ import annotations

from otfload.errors import UnsupportedModelError
from otfload.models.llama import LlamaConfig
from otfload.models.moe import CLAMPED_SWIGLU, TOPK_SOFTMAX, MoeConfig

SLIDING, FULL = "sliding_attention", "full_attention"


def gpt_oss_config(hf: dict) -> MoeConfig:
    """The :class:`MoeConfig` of a GPT-OSS ``config.json``."""
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(n)]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise UnsupportedModelError(f"gpt_oss: unsupported layer types {unknown}")
    return MoeConfig.extend(
        LlamaConfig.from_hf(hf),
        sliding_window=hf.get("sliding_window"),
        sliding_layers=tuple(i for i, t in enumerate(types) if t == SLIDING),
        attention_sinks=True,
        num_experts=hf["num_local_experts"],
        experts_per_token=hf["num_experts_per_tok"],
        expert_intermediate_size=hf["intermediate_size"],
        routing=TOPK_SOFTMAX,
        router_bias=True,
        expert_bias=True,
        activation=CLAMPED_SWIGLU,
        swiglu_alpha=float(hf.get("swiglu_alpha", 1.702)),
        swiglu_limit=float(hf.get("swiglu_limit", 7.0)),
        moe_layers=tuple(range(n)),
        experts_in_first=True,  # the fused expert tensors are stored [E, in, out]
    )
