"""Llama 4's text config (``llama4_text``; ``text_config`` of ``llama4``): ``config.json`` parsed and
checked into a :class:`Llama4Config`.

Each layer's feed-forward is routed experts plus a shared expert (the layers of ``moe_layers``, by
default every ``interleave_moe_layer_step``-th) or a dense MLP of ``intermediate_size_mlp``; each
layer's attention uses RoPE or not (``no_rope_layers``: 1 = RoPE, by default all but every
``no_rope_layer_interval``-th), and is chunked (``layer_types``, by default the RoPE layers when
``attention_chunk_size`` is set) or full. The two feed-forward kinds are two layer groups whose HF
layers are config fields (``dense_layers``, ``moe_layers``) the mapping's rules index by; the
attention kind is a per-layer flag (``use_rope``, ``chunked``), so it needs no group of its own."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from otfload.config import (
    BOOL,
    EXPERTS,
    INTERMEDIATE,
    POSITIVE,
    WINDOW,
    Choice,
    Fields,
    Int,
    List,
    padding_idx,
    require,
    rope_params,
)
from otfload.config.fields import MAX_CONTEXT, MAX_LAYERS
from otfload.errors import ConfigError
from otfload.families.gqa_shape import DecoderShape

ACTIVATIONS = Choice("silu", "swish")
CHUNKED, FULL = "chunked_attention", "full_attention"
LAYER_TYPES = Choice(CHUNKED, FULL)
FLAG = Int(0, 1)
LAYER = Int(0, MAX_LAYERS - 1)
# transformers' Llama4TextConfig defaults.
DEFAULT_THETA = 500000.0
DEFAULT_NOPE_INTERVAL = 4
DEFAULT_CHUNK = 8192


def _moe_layers(f: Fields, n: int) -> tuple[int, ...]:
    step = f.get("interleave_moe_layer_step", Int(1, max(n, 1)), 1)
    listed = f.nullable("moe_layers", List(LAYER), None)
    if listed is None:
        return tuple(range(step - 1, n, step))
    require(all(i < n for i in listed) and len(set(listed)) == len(listed), "moe_layers", list(listed),
            f"must list distinct layers below num_hidden_layers ({n})")
    return tuple(sorted(listed))


def _use_rope(f: Fields, n: int) -> tuple[bool, ...]:
    listed = f.nullable("no_rope_layers", List(FLAG), None)
    if not listed:  # transformers treats an empty list as absent
        interval = f.get("no_rope_layer_interval", Int(1, MAX_LAYERS), DEFAULT_NOPE_INTERVAL)
        return tuple((i + 1) % interval != 0 for i in range(n))
    require(len(listed) >= n, "no_rope_layers", list(listed), f"must give a 0/1 flag for each of the {n} layers")
    return tuple(bool(v) for v in listed[:n])


def _chunked(f: Fields, use_rope: tuple[bool, ...], chunk: int | None) -> tuple[bool, ...]:
    types = f.nullable("layer_types", List(LAYER_TYPES), None)
    if types is None:
        return tuple(r and chunk is not None for r in use_rope)
    require(len(types) == len(use_rope), "layer_types", list(types),
            f"must name one type per layer ({len(use_rope)})")
    if CHUNKED in types and chunk is None:
        raise ConfigError("attention_chunk_size", None, f"must be set: layer_types names {CHUNKED!r} layers")
    return tuple(t == CHUNKED for t in types)


@dataclass(frozen=True)
class Llama4Config(DecoderShape):
    """A Llama 4 text config as the model uses it, under the config's names (``to_dict()`` feeds the
    mapping's hooks and indices), except ``num_experts`` (``num_local_experts``); ``use_qk_norm`` is a
    weightless RMS norm of q and k on RoPE layers (``qk_norm``, learned norms, is always false). ``use_rope[i]`` and
    ``chunked[i]`` are layer ``i``'s attention kind; ``dense_layers``/``moe_layers`` the HF layers of
    each group."""

    intermediate_size: int
    intermediate_size_mlp: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    num_experts: int
    num_experts_per_tok: int
    use_qk_norm: bool
    attention_chunk_size: int | None
    attn_temperature_tuning: bool
    floor_scale: int
    attn_scale: float
    use_rope: tuple[bool, ...]
    chunked: tuple[bool, ...]
    dense_layers: tuple[int, ...]
    moe_layers: tuple[int, ...]
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    pad_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Llama4Config:
        """Parse and check ``config.json`` (absent fields take transformers' Llama 4 defaults)."""
        f = Fields(hf)
        shape = DecoderShape.parse(f, eps=1e-5)
        f.get("hidden_act", ACTIVATIONS, "silu")
        n = shape["num_hidden_layers"]
        experts = f.get("num_local_experts", EXPERTS, 16)
        top_k = f.get("num_experts_per_tok", Int(1, experts), 1)
        theta, scaling = rope_params(f)
        if "rope_theta" not in hf and "rope_theta" not in (f.object("rope_parameters") or Fields({})).data:
            theta = DEFAULT_THETA
        chunk = f.nullable("attention_chunk_size", WINDOW, DEFAULT_CHUNK)
        use_rope = _use_rope(f, n)
        moe = _moe_layers(f, n)
        bias = f.get("attention_bias", BOOL, False)
        vocab = shape["vocab_size"]
        return cls(
            **shape,
            intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            intermediate_size_mlp=f.get("intermediate_size_mlp", INTERMEDIATE, 16384),
            rope_theta=theta,
            rope_scaling=scaling,
            num_experts=experts,
            num_experts_per_tok=top_k,
            use_qk_norm=f.get("use_qk_norm", BOOL, True),
            attention_chunk_size=chunk,
            attn_temperature_tuning=f.get("attn_temperature_tuning", BOOL, True),
            floor_scale=f.get("floor_scale", Int(1, MAX_CONTEXT), 8192),
            attn_scale=f.get("attn_scale", POSITIVE, 0.1),
            use_rope=use_rope,
            chunked=_chunked(f, use_rope, chunk),
            dense_layers=tuple(i for i in range(n) if i not in moe),
            moe_layers=moe,
            qkv_bias=bias,
            o_bias=bias,
            pad_token_id=padding_idx(f, vocab),
        )

