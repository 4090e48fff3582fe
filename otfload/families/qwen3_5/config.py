"""Qwen3.5's text config (``qwen3_5_text``, ``qwen3_5_moe_text``; ``text_config`` of the multimodal
``qwen3_5`` / ``qwen3_5_moe``): ``config.json`` parsed and checked into a :class:`Qwen35Config`.

Layers are Gated DeltaNet (``linear_attention``) or gated full attention (``full_attention``) by
``layer_types`` (default: every ``full_attention_interval``-th layer full); the two kinds are groups
of their own shapes, whose HF layers are the config lists ``linear_layers`` and
``attention_layers`` the mapping indexes by. Attention has the output gate in ``q_proj``
(``attn_output_gate``, required), per-head q/k norms and partial rotary (``partial_rotary_factor``,
0.25 by default) of the text positions: the multimodal RoPE's sections all take the same position,
which makes it plain RoPE. The MoE model types replace every layer's MLP by routed experts (softmax,
top k, renormalised) plus a shared expert gated by a sigmoid.

Refused by name: another activation than SiLU (the convolution's and the MLPs'), attention biases,
no output gate, a recurrent state dtype other than float32 (``mamba_ssm_dtype``), a RoPE kind other
than the default, dense layers among MoE ones (``mlp_only_layers``), an unknown layer type.
"""

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
    INTERMEDIATE,
    LAYERS,
    NAME,
    VOCAB,
    Choice,
    Fields,
    Int,
    List,
    padding_idx,
    require,
    rope_kind,
)
from otfload.config.layer_types import FULL
from otfload.config.rope import THETA, rotary_dim
from otfload.errors import ConfigError
from otfload.families.gqa_shape import attention_shape
from otfload.models.moe import SOFTMAX_TOPK, SWIGLU

LINEAR = "linear_attention"
LAYER_TYPES = List(Choice(LINEAR, FULL))
MOE_TYPES = ("qwen3_5_moe_text",)
ACTIVATIONS = Choice("silu", "swish")
STATE_DTYPES = Choice("float32")
CONV_TAPS = Int(1, 64)
# transformers' Qwen3.5 defaults.
DEFAULT_THETA = 10000.0
DEFAULT_ROTARY = 0.25
FULL_EVERY = 4


def _layer_types(f: Fields, n: int) -> tuple[str, ...]:
    types: tuple[str, ...] | None = f.get("layer_types", LAYER_TYPES, None)
    if types is None:
        every = f.get("full_attention_interval", Int(1, n), FULL_EVERY)
        types = tuple(LINEAR if (i + 1) % every else FULL for i in range(n))
    require(len(types) == n, f.name("layer_types"), list(types),
            f"must list one type per layer (num_hidden_layers = {n})")
    return types


def _theta(f: Fields) -> float:
    """The RoPE base; only the default kind (of any multimodal sections) is implemented."""
    params = f.object("rope_parameters")
    theta: float = f.get("rope_theta", THETA, DEFAULT_THETA)
    if params is None:
        return theta
    kind = rope_kind(params)
    if kind != "default":
        raise ConfigError(params.name("rope_type"), kind, "Qwen3.5's RoPE is implemented for the default kind only")
    return float(params.get("rope_theta", THETA, theta))


@dataclass(frozen=True)
class Qwen35Config:
    """A Qwen3.5 text config as the model uses it, under the config's names (``to_dict()`` feeds the
    mapping's hooks and indices). ``num_experts`` is 0 for the dense models; the fixed fields are
    what the shared attention/MoE blocks read."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    rope_theta: float
    rotary_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    conv_dim: int
    linear_layers: tuple[int, ...]
    attention_layers: tuple[int, ...]
    pad_token_id: int | None
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = True
    mlp_bias: bool = False
    routing: str = SOFTMAX_TOPK
    norm_topk_prob: bool = True
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = SWIGLU
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    attention_sinks: bool = False
    experts_in_first: bool = False

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Qwen35Config:
        """Parse and check ``config.json`` (absent fields take transformers' Qwen3.5 defaults)."""
        f = Fields(hf)
        model_type = f.get("model_type", NAME)
        hidden, heads, kv_heads, head_dim = attention_shape(f)
        f.get("hidden_act", ACTIVATIONS, "silu")
        f.get("mamba_ssm_dtype", STATE_DTYPES, "float32")
        if f.get("attention_bias", BOOL, False):
            raise ConfigError(f.name("attention_bias"), True, "Qwen3.5 attention biases are not supported")
        if not f.get("attn_output_gate", BOOL, True):
            raise ConfigError(f.name("attn_output_gate"), False, "Qwen3.5 attention without its output gate "
                              "is not supported")
        n = f.get("num_hidden_layers", LAYERS)
        types = _layer_types(f, n)
        hk, hv = f.get("linear_num_key_heads", HEADS, 16), f.get("linear_num_value_heads", HEADS, 32)
        require(hv % hk == 0, f.name("linear_num_value_heads"), hv,
                f"must be a multiple of linear_num_key_heads ({hk}): each key head serves whole value heads")
        dk, dv = f.get("linear_key_head_dim", HEAD_DIM, 128), f.get("linear_value_head_dim", HEAD_DIM, 128)
        moe = model_type in MOE_TYPES
        experts = f.get("num_experts", EXPERTS, 256) if moe else 0
        if moe and f.get("mlp_only_layers", List(Int(0, n - 1)), ()):
            raise ConfigError(f.name("mlp_only_layers"), f.data["mlp_only_layers"],
                              "dense layers among Qwen3.5's MoE layers are not supported")
        vocab = f.get("vocab_size", VOCAB)
        return cls(
            model_type=model_type,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=0 if moe else f.get("intermediate_size", INTERMEDIATE, 12288),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.get("rms_norm_eps", EPS, 1e-6),
            tie_word_embeddings=f.get("tie_word_embeddings", BOOL, False),
            layer_types=types,
            rope_theta=_theta(f),
            rotary_dim=rotary_dim(f, head_dim, DEFAULT_ROTARY),
            linear_num_key_heads=hk,
            linear_num_value_heads=hv,
            linear_key_head_dim=dk,
            linear_value_head_dim=dv,
            linear_conv_kernel_dim=f.get("linear_conv_kernel_dim", CONV_TAPS, 4),
            conv_dim=2 * hk * dk + hv * dv,
            linear_layers=tuple(i for i, t in enumerate(types) if t == LINEAR),
            attention_layers=tuple(i for i, t in enumerate(types) if t == FULL),
            pad_token_id=padding_idx(f, vocab),
            num_experts=experts,
            num_experts_per_tok=f.get("num_experts_per_tok", Int(1, experts), 8) if moe else 0,
            moe_intermediate_size=f.get("moe_intermediate_size", INTERMEDIATE, 512) if moe else 0,
            shared_expert_intermediate_size=f.get("shared_expert_intermediate_size", INTERMEDIATE, 512) if moe else 0,
        )

    def to_dict(self) -> dict[str, Any]:
        """Field name → value, for the mapping table's hooks and indices."""
        return dataclasses.asdict(self)
