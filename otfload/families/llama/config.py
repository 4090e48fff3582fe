"""The Llama family's config: ``config.json`` parsed and checked into a :class:`LlamaConfig`
(Llama 3, Mistral, Qwen2, Qwen3; Mixtral's, Qwen3-MoE's and GPT-OSS's configs extend it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.config import (
    BOOL,
    INTERMEDIATE,
    WINDOW,
    Choice,
    Fields,
    padding_idx,
    rope_params,
)
from otfload.families.gqa_shape import DecoderShape

# transformers' names of the activation Llama-family MLPs apply (SiLU; "swish" is the same function).
ACTIVATIONS = Choice("silu", "swish")


@dataclass(frozen=True)
class LlamaConfig(DecoderShape):
    """A Llama-family ``config.json`` as the model uses it. Fields read from the config keep its
    names (``num_attention_heads``, ``num_hidden_layers``, ...), the names the mapping's hooks use
    through :meth:`to_dict`; ``qkv_bias``/``o_bias``/``qk_norm`` follow from ``model_type``."""

    intermediate_size: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
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
        shape = DecoderShape.parse(f)
        model_type = shape["model_type"]
        f.get("hidden_act", ACTIVATIONS, "silu")
        theta, scaling = rope_params(f)
        attention_bias = f.get("attention_bias", BOOL, False)
        use_window = f.get("use_sliding_window", BOOL, model_type == "mistral")
        return cls(
            **shape,
            intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            rope_theta=theta,
            rope_scaling=scaling,
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=f.get("mlp_bias", BOOL, False),
            qk_norm=model_type == "qwen3",
            sliding_window=f.nullable("sliding_window", WINDOW, None) if use_window else None,
            pad_token_id=padding_idx(f, shape["vocab_size"]),
        )
