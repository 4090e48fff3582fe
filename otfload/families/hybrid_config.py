"""What the Gated DeltaNet hybrids' configs share (Qwen3.5, Qwen3-Next): :class:`HybridConfig`, the
config the hybrid decoder (:mod:`otfload.models.hybrid_decoder`) reads, and :func:`hybrid_fields`,
the fields both parse alike.

Layers are Gated DeltaNet (``linear_attention``) or gated full attention (``full_attention``) by
``layer_types`` (default: every ``full_attention_interval``-th layer full). Attention has the output
gate in ``q_proj``, per-head q/k norms and partial rotary (``partial_rotary_factor``, 0.25 by
default). Refused by name: another activation than SiLU (the convolution's and the MLPs'), attention
biases, no output gate (``attn_output_gate``), a recurrent state dtype other than float32
(``mamba_ssm_dtype``), a RoPE kind other than the default, an unknown layer type, value heads that
are not a multiple of the key heads.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from otfload.config import (
    BOOL,
    EPS,
    HEAD_DIM,
    HEADS,
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
from otfload.models.hybrid_decoder import LayerKind
from otfload.models.moe import SOFTMAX_TOPK, SWIGLU

LINEAR = "linear_attention"
LAYER_TYPES = List(Choice(LINEAR, FULL))
ACTIVATIONS = Choice("silu", "swish")
STATE_DTYPES = Choice("float32")
CONV_TAPS = Int(1, 64)
# transformers' Qwen3.5 and Qwen3-Next defaults.
DEFAULT_THETA = 10000.0
DEFAULT_ROTARY = 0.25
FULL_EVERY = 4
# The groups of linear and of attention layers (with routed experts where the model has them).
LINEAR_GROUP, ATTENTION_GROUP = "linear_layers", "attention_layers"


def _layer_types(f: Fields, n: int) -> tuple[str, ...]:
    types: tuple[str, ...] | None = f.get("layer_types", LAYER_TYPES, None)
    if types is None:
        every = f.get("full_attention_interval", Int(1, n), FULL_EVERY)
        types = tuple(LINEAR if (i + 1) % every else FULL for i in range(n))
    require(len(types) == n, f.name("layer_types"), list(types),
            f"must list one type per layer (num_hidden_layers = {n})")
    return types


def _theta(f: Fields, family: str) -> float:
    """The RoPE base; only the default kind (of any multimodal sections) is implemented."""
    params = f.object("rope_parameters")
    theta: float = f.get("rope_theta", THETA, DEFAULT_THETA)
    if params is None:
        return theta
    kind = rope_kind(params)
    if kind != "default":
        raise ConfigError(params.name("rope_type"), kind, f"{family}'s RoPE is implemented for the default kind only")
    return float(params.get("rope_theta", THETA, theta))


def hybrid_fields(f: Fields, family: str) -> dict[str, Any]:
    """The :class:`HybridConfig` fields both families parse alike (all but the feed-forwards' and the
    layer groups'), checked; ``family`` names the model in the refusals."""
    hidden, heads, kv_heads, head_dim = attention_shape(f)
    f.get("hidden_act", ACTIVATIONS, "silu")
    f.get("mamba_ssm_dtype", STATE_DTYPES, "float32")
    if f.get("attention_bias", BOOL, False):
        raise ConfigError(f.name("attention_bias"), True, f"{family} attention biases are not supported")
    if not f.get("attn_output_gate", BOOL, True):
        raise ConfigError(f.name("attn_output_gate"), False, f"{family} attention without its output gate "
                          "is not supported")
    n = f.get("num_hidden_layers", LAYERS)
    hk, hv = f.get("linear_num_key_heads", HEADS, 16), f.get("linear_num_value_heads", HEADS, 32)
    require(hv % hk == 0, f.name("linear_num_value_heads"), hv,
            f"must be a multiple of linear_num_key_heads ({hk}): each key head serves whole value heads")
    dk, dv = f.get("linear_key_head_dim", HEAD_DIM, 128), f.get("linear_value_head_dim", HEAD_DIM, 128)
    vocab = f.get("vocab_size", VOCAB)
    return dict(
        model_type=f.get("model_type", NAME),
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=n,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=f.get("rms_norm_eps", EPS, 1e-6),
        tie_word_embeddings=f.get("tie_word_embeddings", BOOL, False),
        layer_types=_layer_types(f, n),
        rope_theta=_theta(f, family),
        rotary_dim=rotary_dim(f, head_dim, DEFAULT_ROTARY),
        linear_num_key_heads=hk,
        linear_num_value_heads=hv,
        linear_key_head_dim=dk,
        linear_value_head_dim=dv,
        linear_conv_kernel_dim=f.get("linear_conv_kernel_dim", CONV_TAPS, 4),
        conv_dim=2 * hk * dk + hv * dv,
        pad_token_id=padding_idx(f, vocab),
    )


@dataclass(frozen=True)
class HybridConfig:
    """A hybrid's config as the model uses it, under the config's names (``to_dict()`` feeds the
    mapping's hooks and indices). ``num_experts`` is 0 for dense models; the fixed fields are what
    the shared attention/MoE blocks read. ``linear_layers`` and ``attention_layers`` list the HF
    layers of the two groups :meth:`layer_kinds` gives (a family may add groups)."""

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
    norm_topk_prob: bool = True
    qkvz_per_key_head: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = True
    mlp_bias: bool = False
    routing: str = SOFTMAX_TOPK
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = SWIGLU
    swiglu_alpha: float = 0.0
    swiglu_limit: float = 0.0
    attention_sinks: bool = False
    experts_in_first: bool = False

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The linear and the attention group (routed experts in both if the model has experts),
        those that have layers."""
        moe = bool(self.num_experts)
        kinds = (LayerKind(LINEAR_GROUP, True, moe), LayerKind(ATTENTION_GROUP, False, moe))
        return tuple(k for k in kinds if getattr(self, k.group))

    def to_dict(self) -> dict[str, Any]:
        """Field name → value, for the mapping table's hooks and indices."""
        return dataclasses.asdict(self)
