"""GLM-4.5 / GLM-4.6's config (``glm4_moe``): ``config.json`` parsed and checked into a
:class:`Glm4MoeConfig` (GQA with q/k/v biases, optional per-head q/k norms and partial rotary; the
first ``first_k_dense_replace`` layers dense, the rest routed experts with sigmoid group routing, a
correction bias and shared experts; the MTP layers after the last layer are never read)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.config import (
    BOOL,
    EXPERTS,
    INTERMEDIATE,
    POSITIVE,
    Choice,
    Fields,
    Int,
    padding_idx,
    require,
    rope_params,
)
from otfload.config.fields import MAX_EXPERTS, MAX_LAYERS
from otfload.config.rope import rotary_dim
from otfload.families.gqa_shape import DecoderShape

ACTIVATIONS = Choice("silu", "swish")
# transformers' field names first (``num_local_experts``/``num_mtp_layers`` are its aliases).
EXPERT_FIELDS = ("n_routed_experts", "num_local_experts")
MTP_FIELDS = ("num_nextn_predict_layers", "num_mtp_layers")
COUNT = Int(0, MAX_EXPERTS)
DENSE_LAYERS = Int(0, MAX_LAYERS)
# GLM-4.5 rotates half of each head (transformers' default when the config names no factor).
DEFAULT_PARTIAL_ROTARY = 0.5
# The one routing rule of transformers' Glm4MoeTopkRouter: sigmoid scores, groups ranked by the sum
# of their top-2 (score + correction bias), top-k within the kept groups.
TOPK_METHOD = "noaux_tc"


@dataclass(frozen=True)
class Glm4MoeConfig(DecoderShape):
    """A GLM-4.5 ``config.json`` as the model uses it, under the config's names (``to_dict()`` feeds
    the mapping's hooks), except ``num_experts`` (``n_routed_experts``) and ``mtp_layers``
    (``num_nextn_predict_layers``), named as in the other MoE configs. ``sigmoid_routing`` is always
    true (every GLM-4.5 router scores by sigmoid and has ``e_score_correction_bias``)."""

    intermediate_size: int
    moe_intermediate_size: int
    first_k_dense_replace: int
    rotary_dim: int
    qk_norm: bool
    qkv_bias: bool
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    num_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    o_bias: bool = False
    mlp_bias: bool = False
    sigmoid_routing: bool = True
    topk_method: str = TOPK_METHOD
    mtp_layers: int = 0  # multi-token-prediction layers stored after the last layer (never read)
    pad_token_id: int | None = None

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Glm4MoeConfig:
        """Parse and check ``config.json`` (absent fields take transformers' GLM-4.5 defaults)."""
        f = Fields(hf)
        shape = DecoderShape.parse(f, eps=1e-5)
        head_dim = shape["head_dim"]
        f.get("hidden_act", ACTIVATIONS, "silu")
        layers = shape["num_hidden_layers"]
        experts_field, experts = f.first(EXPERT_FIELDS, EXPERTS, 128)
        top_k = f.get("num_experts_per_tok", EXPERTS, 8)
        require(top_k <= experts, "num_experts_per_tok", top_k, f"must be at most {experts_field} ({experts})")
        n_group = f.get("n_group", EXPERTS, 1)
        require(experts % n_group == 0 and experts // n_group >= 2, "n_group", n_group,
                f"must divide {experts_field} ({experts}) into equal groups of at least 2 experts")
        topk_group = f.get("topk_group", EXPERTS, 1)
        require(topk_group <= n_group, "topk_group", topk_group, f"must be at most n_group ({n_group})")
        theta, scaling = rope_params(f)
        vocab = shape["vocab_size"]
        return cls(
            **shape,
            intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            moe_intermediate_size=f.get("moe_intermediate_size", INTERMEDIATE),
            first_k_dense_replace=min(f.get("first_k_dense_replace", DENSE_LAYERS, 1), layers),
            rotary_dim=rotary_dim(f, head_dim, DEFAULT_PARTIAL_ROTARY),
            qk_norm=f.get("use_qk_norm", BOOL, False),
            qkv_bias=f.get("attention_bias", BOOL, False),
            rope_theta=theta,
            rope_scaling=scaling,
            num_experts=experts,
            num_experts_per_tok=top_k,
            n_shared_experts=f.get("n_shared_experts", COUNT, 1),
            n_group=n_group,
            topk_group=topk_group,
            norm_topk_prob=f.get("norm_topk_prob", BOOL, True),
            routed_scaling_factor=f.get("routed_scaling_factor", POSITIVE, 1.0),
            mtp_layers=f.first(MTP_FIELDS, DENSE_LAYERS, 1)[1],
            pad_token_id=padding_idx(f, vocab),
        )

