"""Gemma 2 and Gemma 3 (text) config: ``config.json`` parsed and checked into a :class:`GemmaConfig`,
including Gemma 3's per-layer-type RoPE and the sliding/global layer pattern."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.config import (
    BOOL,
    EPS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    NAME,
    POSITIVE,
    VOCAB,
    WINDOW,
    Choice,
    Fields,
    Float,
    padding_idx,
    require,
    rope_kind,
    rope_params,
)
from otfload.config.fields import MAX_FACTOR
from otfload.config.layer_types import FULL, SLIDING, layer_types
from otfload.config.rope import THETA
from otfload.errors import ConfigError
from otfload.families.gqa_shape import DecoderShape

# transformers' activation name -> whether GELU uses the tanh approximation.
_GELU_APPROXIMATE = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu_fast": True, "gelu": False}
ACTIVATIONS = Choice(*_GELU_APPROXIMATE)
SOFTCAP = Float(0.0, MAX_FACTOR, exclusive_min=True)
# transformers' Gemma 2 and Gemma 3 configs default pad_token_id to 0 (the others to None).
GEMMA_PAD_ID = 0

Rope = tuple[float, dict[str, Any] | None]  # (theta, scaling)


def _rope_of(params: Fields | None, default_theta: float) -> Rope:
    if params is None:
        return default_theta, None
    kind = rope_kind(params)
    theta = params.get("rope_theta", THETA, default_theta)
    return theta, (dict(params.data) if kind != "default" else None)


def _gemma3_ropes(f: Fields) -> tuple[Rope, Rope]:
    """``(global, local)`` RoPE of Gemma 3: per layer type in transformers 5 configs, else the
    older ``rope_theta`` / ``rope_scaling`` (global) and ``rope_local_base_freq`` (local) fields."""
    params = f.object("rope_parameters")
    if params is not None and (FULL in params.data or SLIDING in params.data):
        return _rope_of(params.object(FULL), 1e6), _rope_of(params.object(SLIDING), 1e4)
    scaling = f.object("rope_scaling")
    theta = f.get("rope_theta", THETA, 1e6)
    full = Fields({**(scaling.data if scaling else {}), "rope_theta": theta}, f.name("rope_scaling"))
    local = f.get("rope_local_base_freq", THETA, 1e4)
    return _rope_of(full, 1e6), (local, None)


def _pattern_types(f: Fields, model_type: str, num_hidden_layers: int) -> list[str]:
    """Each layer's attention type when ``layer_types`` is absent: every ``pattern``-th layer is global."""
    default = 2 if model_type == "gemma2" else 6
    _, pattern = f.first(("sliding_window_pattern", "_sliding_window_pattern"), LAYERS, default)
    return [SLIDING if (i + 1) % pattern else FULL for i in range(num_hidden_layers)]


@dataclass(frozen=True)
class GemmaConfig(DecoderShape):
    """Gemma 2 / Gemma 3 text config. Its fields' names, shared with every decoder config, let the
    shared attention and MLP parameter modules (and mapping rules) serve Gemma unchanged; Gemma
    checks its attention shape its own way (``head_dim`` defaults to 256, not ``hidden / heads``)."""

    intermediate_size: int
    query_pre_attn_scalar: float
    sliding_window: int | None
    layer_types: tuple[str, ...]
    rope_global: Rope
    rope_local: Rope
    gelu_approximate: bool
    attn_softcap: float | None
    final_softcap: float | None
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool = False
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], path: str = "") -> GemmaConfig:
        """Parse and check ``config.json`` (``path`` names a nested text config in errors); absent
        fields take transformers' Gemma defaults."""
        f = Fields(hf, path)
        model_type = f.get("model_type", NAME)
        if f.get("use_bidirectional_attention", BOOL, False):
            raise ConfigError(f.name("use_bidirectional_attention"), True, "bidirectional attention is not supported")
        _, activation = f.first(("hidden_activation", "hidden_act"), ACTIVATIONS, "gelu_pytorch_tanh")
        gemma2 = model_type == "gemma2"
        if gemma2:
            rope_global = rope_local = rope_params(f)
        else:
            rope_global, rope_local = _gemma3_ropes(f)
        heads = f.get("num_attention_heads", HEADS)
        kv_heads = f.get("num_key_value_heads", HEADS, heads)
        require(heads % kv_heads == 0, f.name("num_key_value_heads"), kv_heads,
                f"must divide num_attention_heads ({heads}): each key/value head serves a whole group of query heads")
        head_dim = f.get("head_dim", HEAD_DIM, 256)
        require(head_dim % 2 == 0, f.name("head_dim"), head_dim, "must be even: RoPE rotates pairs of dimensions")
        num_hidden_layers = f.get("num_hidden_layers", LAYERS)
        bias = f.get("attention_bias", BOOL, False)
        return cls(
            model_type=model_type,
            vocab_size=f.get("vocab_size", VOCAB),
            hidden_size=f.get("hidden_size", HIDDEN),
            intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.get("rms_norm_eps", EPS, 1e-6),
            tie_word_embeddings=f.get("tie_word_embeddings", BOOL, True),
            query_pre_attn_scalar=f.get("query_pre_attn_scalar", POSITIVE, 256.0),
            sliding_window=f.nullable("sliding_window", WINDOW, 4096),
            layer_types=layer_types(f, num_hidden_layers, lambda: _pattern_types(f, model_type, num_hidden_layers)),
            rope_global=rope_global,
            rope_local=rope_local,
            gelu_approximate=_GELU_APPROXIMATE[activation],
            # transformers' Gemma 3 attention never soft-caps its logits, whatever the config says.
            attn_softcap=f.nullable("attn_logit_softcapping", SOFTCAP, 50.0) if gemma2 else None,
            final_softcap=f.nullable("final_logit_softcapping", SOFTCAP, 30.0 if gemma2 else None),
            qk_norm=not gemma2,
            qkv_bias=bias,
            o_bias=bias,
            pad_token_id=padding_idx(f, f.get("vocab_size", VOCAB), GEMMA_PAD_ID),
        )
