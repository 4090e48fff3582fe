"""The Llama family's config: ``config.json`` parsed and checked into a :class:`LlamaConfig`
(Llama 3, Mistral, Qwen2, Qwen3; Mixtral's, Qwen3-MoE's and GPT-OSS's configs extend it)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.config import (
    BOOL,
    EPS,
    INTERMEDIATE,
    LAYERS,
    NAME,
    VOCAB,
    WINDOW,
    Choice,
    Fields,
    padding_idx,
    rope_params,
)
from otfload.families.gqa_shape import attention_shape

# transformers' names of the activation Llama-family MLPs apply (SiLU; "swish" is the same function).
ACTIVATIONS = Choice("silu", "swish")


@dataclass(frozen=True)
class LlamaConfig:
    """A Llama-family ``config.json`` as the model uses it. Fields read from the config keep its
    names (``num_attention_heads``, ``num_hidden_layers``, ...), the names the mapping's hooks use
    through :meth:`to_dict`; ``qkv_bias``/``o_bias``/``qk_norm`` follow from ``model_type``."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """Parse and check ``config.json`` (absent fields take transformers' defaults)."""
        f = Fields(hf)
        model_type = f.get("model_type", NAME)
        hidden, heads, kv_heads, head_dim = attention_shape(f)
        f.get("hidden_act", ACTIVATIONS, "silu")
        theta, scaling = rope_params(f)
        attention_bias = f.get("attention_bias", BOOL, False)
        use_window = f.get("use_sliding_window", BOOL, model_type == "mistral")
        return cls(
            model_type=model_type,
            vocab_size=f.get("vocab_size", VOCAB),
            hidden_size=hidden,
            intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            num_hidden_layers=f.get("num_hidden_layers", LAYERS),
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.get("rms_norm_eps", EPS, 1e-6),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=f.get("tie_word_embeddings", BOOL, False),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=f.get("mlp_bias", BOOL, False),
            qk_norm=model_type == "qwen3",
            sliding_window=f.nullable("sliding_window", WINDOW, None) if use_window else None,
            pad_token_id=padding_idx(f, f.get("vocab_size", VOCAB)),
        )

    def to_dict(self) -> dict[str, Any]:
        """Field name → value, for the mapping table's hooks."""
        return dataclasses.asdict(self)
