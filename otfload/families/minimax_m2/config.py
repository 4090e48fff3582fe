"""MiniMax-M2's config (``minimax_m2``): ``config.json`` parsed and checked into a
:class:`MiniMaxM2Config` (GQA with q/k norms over the whole projections and partial rotary; every
layer routed experts, sigmoid scores with a correction bias choosing the top k, no shared experts;
the MTP modules are never read).

The published config carries fields of MiniMax's own code that transformers' model fixes; each is
accepted only at the value that model implements (``use_qk_norm`` true, ``qk_norm_type``
``"per_layer"``, ``use_routing_bias`` true, ``scoring_func`` ``"sigmoid"``,
``shared_intermediate_size`` 0), any other value is a :class:`~otfload.errors.ConfigError` naming it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.config import (
    BOOL,
    EXPERTS,
    INTERMEDIATE,
    Choice,
    Fields,
    Int,
    Str,
    padding_idx,
    require,
    rope_params,
)
from otfload.config.fields import Spec
from otfload.config.rope import rotary_dim
from otfload.families.gqa_shape import DecoderShape

ACTIVATIONS = Choice("silu", "swish")
# Fields of MiniMax's remote code, each accepted at the one value transformers' model implements.
FIXED: dict[str, tuple[Spec, object]] = {
    "use_qk_norm": (BOOL, True), "qk_norm_type": (Str(), "per_layer"), "use_routing_bias": (BOOL, True),
    "scoring_func": (Str(), "sigmoid"), "shared_intermediate_size": (Int(0), 0),
}


@dataclass(frozen=True)
class MiniMaxM2Config(DecoderShape):
    """A MiniMax-M2 ``config.json`` as the model uses it, under the config's names (``to_dict()``
    feeds the mapping's hooks), except ``num_experts`` (``num_local_experts``). The routing fields
    of the grouped router (one group, no scaling, top-k weights renormalised) are constants."""

    rotary_dim: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int  # the experts' width: ``intermediate_size`` in the config
    qk_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    n_shared_experts: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    sigmoid_routing: bool = True
    topk_method: str = "noaux_tc"
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> MiniMaxM2Config:
        """Parse and check ``config.json`` (absent fields take transformers' MiniMax-M2 defaults)."""
        f = Fields(hf)
        shape = DecoderShape.parse(f)
        head_dim = shape["head_dim"]
        f.get("hidden_act", ACTIVATIONS, "silu")
        for name, (spec, value) in FIXED.items():
            found = f.get(name, spec, value)
            require(found == value, name, found, f"only {value!r} is supported (transformers' MiniMax-M2 model)")
        experts = f.get("num_local_experts", EXPERTS, 256)
        top_k = f.get("num_experts_per_tok", EXPERTS, 8)
        require(top_k <= experts, "num_experts_per_tok", top_k, f"must be at most num_local_experts ({experts})")
        require(experts >= 2, "num_local_experts", experts, "must be at least 2")
        theta, scaling = rope_params(f)
        vocab = shape["vocab_size"]
        return cls(
            **shape,
            rotary_dim=rotary_dim(f, head_dim),
            rope_theta=theta,
            rope_scaling=scaling,
            num_experts=experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            pad_token_id=padding_idx(f, vocab),
        )

