"""DeepSeek-V2/V3 config: ``config.json`` parsed and checked into a :class:`DeepseekConfig` (MLA
ranks and head dims, dense/MoE layer split, routing, RoPE)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.config import (
    BOOL,
    EPS,
    EXPERTS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    NAME,
    POSITIVE,
    VOCAB,
    Choice,
    Fields,
    Int,
    Str,
    padding_idx,
    require,
    rope_params,
)
from otfload.config.fields import MAX_EXPERTS, MAX_LAYERS
from otfload.errors import ConfigError

V2_TOPK_METHODS = ("greedy", "group_limited_greedy")
ACTIVATIONS = Choice("silu", "swish")
# transformers reads ``n_routed_experts``; the other names are accepted as before.
EXPERT_FIELDS = ("n_routed_experts", "num_local_experts", "num_experts")
# Shared experts and dense layers may be none.
COUNT = Int(0, MAX_EXPERTS)
DENSE_LAYERS = Int(0, MAX_LAYERS)
# transformers' V3 config defaults to one multi-token-prediction layer, stored after the last layer
# (``model.layers.{num_hidden_layers}``) and never loaded; V2 has none.
V3_MTP_LAYERS = 1
# Only every layer after the dense ones being MoE is implemented (the published models' layout).
MOE_LAYER_FREQ = Int(1, 1)


@dataclass(frozen=True)
class DeepseekConfig:
    """The fields of a DeepSeek-V2/V3 ``config.json`` the model uses, under the config's names
    (``to_dict()`` feeds the mapping's hooks and offsets), except ``num_experts``: the routed experts
    (``n_routed_experts`` or an alias, :data:`EXPERT_FIELDS`), named as in the other MoE configs.
    ``topk_method`` matters for V2 only: V3 always routes by groups."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    first_k_dense_replace: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    num_experts: int
    num_experts_per_tok: int
    n_shared_experts: int
    n_group: int
    topk_group: int
    topk_method: str
    norm_topk_prob: bool
    routed_scaling_factor: float
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    rope_interleave: bool
    tie_word_embeddings: bool
    mtp_layers: int = 0  # multi-token-prediction layers stored after the last layer (never loaded)
    pad_token_id: int | None = None

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_moe_layers(self) -> int:
        return self.num_hidden_layers - self.first_k_dense_replace

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> DeepseekConfig:
        """Parse and check ``config.json`` (absent fields take transformers' defaults)."""
        f = Fields(hf)
        model_type = f.get("model_type", NAME)
        v3 = model_type == "deepseek_v3"
        for flag in ("attention_bias", "mlp_bias"):
            if f.get(flag, BOOL, False):
                raise ConfigError(flag, True, f"{model_type} with {flag}=true is not supported")
        f.get("hidden_act", ACTIVATIONS, "silu")
        f.get("moe_layer_freq", MOE_LAYER_FREQ, 1)
        methods = Str() if v3 else Choice(*V2_TOPK_METHODS)  # V3 always routes by groups (as transformers)
        topk_method = f.get("topk_method", methods, "noaux_tc" if v3 else "greedy")
        theta, scaling = rope_params(f)
        num_hidden_layers = f.get("num_hidden_layers", LAYERS)
        experts_field, experts = f.first(EXPERT_FIELDS, EXPERTS)
        top_k = f.get("num_experts_per_tok", EXPERTS)
        require(top_k <= experts, "num_experts_per_tok", top_k, f"must be at most {experts_field} ({experts})")
        n_group = f.get("n_group", EXPERTS, 1)
        require(experts % n_group == 0, "n_group", n_group,
                f"must divide {experts_field} ({experts}) into equal groups")
        if v3:  # V3 scores each group by the sum of its top 2 experts
            require(experts // n_group >= 2, "n_group", n_group,
                    f"must leave at least 2 experts per group ({experts_field} = {experts})")
        topk_group = f.get("topk_group", EXPERTS, 1)
        require(topk_group <= n_group, "topk_group", topk_group, f"must be at most n_group ({n_group})")
        rope_dim = f.get("qk_rope_head_dim", HEAD_DIM)
        require(rope_dim % 2 == 0, "qk_rope_head_dim", rope_dim, "must be even: RoPE rotates pairs of dimensions")
        return cls(
            model_type=model_type,
            vocab_size=f.get("vocab_size", VOCAB),
            hidden_size=f.get("hidden_size", HIDDEN),
            intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            moe_intermediate_size=f.get("moe_intermediate_size", INTERMEDIATE),
            num_hidden_layers=num_hidden_layers,
            first_k_dense_replace=min(f.get("first_k_dense_replace", DENSE_LAYERS, 0), num_hidden_layers),
            num_attention_heads=f.get("num_attention_heads", HEADS),
            q_lora_rank=f.get("q_lora_rank", HEAD_DIM, None),
            kv_lora_rank=f.get("kv_lora_rank", HEAD_DIM),
            qk_nope_head_dim=f.get("qk_nope_head_dim", HEAD_DIM),
            qk_rope_head_dim=rope_dim,
            v_head_dim=f.get("v_head_dim", HEAD_DIM),
            num_experts=experts,
            num_experts_per_tok=top_k,
            n_shared_experts=f.get("n_shared_experts", COUNT, 0),
            n_group=n_group,
            topk_group=topk_group,
            topk_method=topk_method,
            norm_topk_prob=f.get("norm_topk_prob", BOOL, False),
            routed_scaling_factor=f.get("routed_scaling_factor", POSITIVE, 1.0),
            rms_norm_eps=f.get("rms_norm_eps", EPS, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            # V2 always rotates interleaved pairs (complex multiplication); V3 makes it a flag.
            rope_interleave=f.get("rope_interleave", BOOL, True) if v3 else True,
            tie_word_embeddings=f.get("tie_word_embeddings", BOOL, False),
            mtp_layers=f.get("num_nextn_predict_layers", DENSE_LAYERS, V3_MTP_LAYERS) if v3 else 0,
            pad_token_id=padding_idx(f, f.get("vocab_size", VOCAB)),
        )

    def to_dict(self) -> dict[str, Any]:
        """Field name → value (and ``qk_head_dim``), for the mapping table's hooks."""
        return {**dataclasses.asdict(self), "qk_head_dim": self.qk_head_dim}
