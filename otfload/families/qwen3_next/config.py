"""Qwen3-Next's config (``qwen3_next``): ``config.json`` parsed and checked into a
:class:`Qwen3NextConfig`.

The mixers, their fields and refusals are those shared with Qwen3.5
(:mod:`otfload.families.hybrid_config`); the Gated DeltaNet projections are fused per key head
(``qkvz_per_key_head``). Layer ``i``'s feed-forward is routed experts plus a sigmoid-gated shared
expert when ``num_experts > 0``, ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is not in
``mlp_only_layers``, else a dense MLP of ``intermediate_size``, as transformers builds it. The layers
are thus up to four groups: linear and attention layers with experts (``linear_layers``,
``attention_layers``) and without (``linear_mlp_layers``, ``attention_mlp_layers``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.config import BOOL, INTERMEDIATE, LAYERS, Fields, Int, List
from otfload.config.fields import MAX_EXPERTS
from otfload.config.layer_types import FULL
from otfload.families.hybrid_config import ATTENTION_GROUP, LINEAR, LINEAR_GROUP, HybridConfig, hybrid_fields
from otfload.models.hybrid_decoder import LayerKind

LINEAR_MLP_GROUP, ATTENTION_MLP_GROUP = "linear_mlp_layers", "attention_mlp_layers"
KINDS = (LayerKind(LINEAR_GROUP, True, True), LayerKind(ATTENTION_GROUP, False, True),
         LayerKind(LINEAR_MLP_GROUP, True, False), LayerKind(ATTENTION_MLP_GROUP, False, False))
# transformers' Qwen3NextConfig defaults that differ from what the shared parser assumes.
DEFAULT_HEAD_DIM = 256


@dataclass(frozen=True)
class Qwen3NextConfig(HybridConfig):
    """A Qwen3-Next config: :class:`~otfload.families.hybrid_config.HybridConfig`'s fields, whose
    ``linear_layers``/``attention_layers`` are the layers with experts, and the dense ones."""

    linear_mlp_layers: tuple[int, ...] = ()
    attention_mlp_layers: tuple[int, ...] = ()

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The four groups (linear or attention, with experts or not), those that have layers."""
        return tuple(k for k in KINDS if getattr(self, k.group))

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Qwen3NextConfig:
        """Parse and check ``config.json`` (absent fields take transformers' Qwen3-Next defaults)."""
        f = Fields({"head_dim": DEFAULT_HEAD_DIM, **hf})
        common = hybrid_fields(f, "Qwen3-Next")
        n, types = common["num_hidden_layers"], common["layer_types"]
        experts = f.get("num_experts", Int(0, MAX_EXPERTS), 512)
        step = f.get("decoder_sparse_step", LAYERS, 1)
        dense = set(f.get("mlp_only_layers", List(Int(0, n - 1)), ()))
        moe = [bool(experts) and (i + 1) % step == 0 and i not in dense for i in range(n)]
        experts = experts if any(moe) else 0

        def layers(kind: str, routed: bool) -> tuple[int, ...]:
            return tuple(i for i, t in enumerate(types) if t == kind and moe[i] == routed)

        return cls(
            **common,
            intermediate_size=f.get("intermediate_size", INTERMEDIATE, 5632),
            linear_layers=layers(LINEAR, True),
            attention_layers=layers(FULL, True),
            linear_mlp_layers=layers(LINEAR, False),
            attention_mlp_layers=layers(FULL, False),
            num_experts=experts,
            num_experts_per_tok=f.get("num_experts_per_tok", Int(1, experts), 10) if experts else 0,
            moe_intermediate_size=f.get("moe_intermediate_size", INTERMEDIATE, 512) if experts else 0,
            shared_expert_intermediate_size=f.get("shared_expert_intermediate_size", INTERMEDIATE, 512)
            if experts else 0,
            norm_topk_prob=f.get("norm_topk_prob", BOOL, True),
            qkvz_per_key_head=True,
        )
