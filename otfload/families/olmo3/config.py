"""OLMo 3's config (``olmo3``): ``config.json`` parsed and checked into an :class:`Olmo3Config`
(GQA with q/k norms over the whole projections, norms after attention and MLP, sliding and full
layers by ``layer_types`` with a RoPE per layer type)."""

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
    rope_kind,
    rope_params,
)
from otfload.config.layer_types import FULL, SLIDING, layer_types
from otfload.config.rope import THETA
from otfload.families.gqa_shape import DecoderShape

ACTIVATIONS = Choice("silu", "swish")
# transformers' Olmo3Config defaults.
DEFAULT_THETA = 500000.0
OLMO3_PAD_ID = 1
# Without ``layer_types`` every 4th layer is full attention, the others sliding (transformers' rule).
FULL_EVERY = 4

RopeSpec = tuple[float, dict[str, Any] | None]  # (theta, scaling)


def _rope_of(params: Fields | None, default: RopeSpec) -> RopeSpec:
    if params is None:
        return default
    kind = rope_kind(params)
    theta = params.get("rope_theta", THETA, default[0])
    return theta, (dict(params.data) if kind != "default" else None)


def layer_ropes(f: Fields) -> tuple[RopeSpec, RopeSpec]:
    """``(full, sliding)`` RoPE: per layer type in ``rope_parameters`` (transformers 5), else the flat
    ``rope_theta``/``rope_scaling`` or ``rope_parameters`` for full layers (transformers applies a
    ``rope_scaling`` there only) and plain RoPE of the same base on sliding layers."""
    params = f.object("rope_parameters")
    if params is not None and (FULL in params.data or SLIDING in params.data):
        plain = (f.get("rope_theta", THETA, DEFAULT_THETA), None)
        return _rope_of(params.object(FULL), plain), _rope_of(params.object(SLIDING), plain)
    theta, scaling = rope_params(Fields({"rope_theta": DEFAULT_THETA, **f.data}, f.path))
    return (theta, scaling), (theta, None)


@dataclass(frozen=True)
class Olmo3Config(DecoderShape):
    """An OLMo 3 ``config.json`` as the model uses it, under the config's names (``to_dict()`` feeds
    the mapping's hooks). ``attention_bias`` gives q/k/v and o biases."""

    intermediate_size: int
    sliding_window: int | None
    layer_types: tuple[str, ...]
    rope_full: RopeSpec
    rope_sliding: RopeSpec
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = True
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Olmo3Config:
        """Parse and check ``config.json`` (absent fields take transformers' OLMo 3 defaults)."""
        f = Fields(hf)
        shape = DecoderShape.parse(f, eps=1e-5)
        f.get("hidden_act", ACTIVATIONS, "silu")
        layers = shape["num_hidden_layers"]
        bias = f.get("attention_bias", BOOL, False)
        full, sliding = layer_ropes(f)

        def pattern() -> list[str]:
            return [SLIDING if (i + 1) % FULL_EVERY else FULL for i in range(layers)]

        return cls(
            **shape,
            intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            sliding_window=f.nullable("sliding_window", WINDOW, 4096),
            layer_types=layer_types(f, layers, pattern),
            rope_full=full,
            rope_sliding=sliding,
            qkv_bias=bias,
            o_bias=bias,
            pad_token_id=padding_idx(f, shape["vocab_size"], OLMO3_PAD_ID),
        )
