"""Mixtral's config: a Mistral decoder whose every feed-forward is a sparse MoE (softmax router over
``num_local_experts``, top ``num_experts_per_tok`` renormalised, SwiGLU experts), parsed into the
:class:`MoeConfig` that Qwen3-MoE's and GPT-OSS's configs use too."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from otfload.config import EXPERTS, WINDOW, Fields, require
from otfload.families.llama.config import LlamaConfig
from otfload.models.moe import SOFTMAX_TOPK, SWIGLU


@dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    """A Llama-style decoder whose feed-forward is a sparse MoE on the layers in ``moe_layers``.

    ``routing``: ``"softmax_topk"`` (softmax over all experts, keep the top k, renormalise if
    ``norm_topk_prob``: Mixtral, Qwen3-MoE) or ``"topk_softmax"`` (top k of the logits, softmax over
    them: GPT-OSS). ``activation``: ``"swiglu"`` or ``"clamped_swiglu"`` (GPT-OSS: gate clamped
    above, up clamped both ways at ``swiglu_limit``, ``(up + 1) * gate * sigmoid(alpha * gate)``).
    ``sliding_layers`` lists the layers using ``sliding_window`` (None: all of them).
    ``experts_in_first``: expert kernels are ``[E, in, out]`` (else ``[E, out, in]``).
    """

    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    routing: str = SOFTMAX_TOPK
    norm_topk_prob: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = SWIGLU
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    attention_sinks: bool = False
    moe_layers: tuple[int, ...] = ()
    dense_layers: tuple[int, ...] = ()
    sliding_layers: tuple[int, ...] | None = None
    experts_in_first: bool = False

    @classmethod
    def extend(cls, base: LlamaConfig, **fields: Any) -> MoeConfig:
        """``base``'s fields plus (or overridden by) ``fields``."""
        return cls(**{**dataclasses.asdict(base), **fields})


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
        num_experts_per_tok=top_k(f, experts, "num_local_experts"),
        moe_intermediate_size=base.intermediate_size,
        norm_topk_prob=True,
        moe_layers=tuple(range(base.num_hidden_layers)),
    )
