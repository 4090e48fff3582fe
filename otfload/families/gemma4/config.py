"""Gemma 4's text config (``gemma4_text``; ``text_config`` of ``gemma4``): ``config.json`` parsed and
checked into a :class:`Gemma4Config`.

Sliding and full ("global") layers by ``layer_types``, the full ones with their own shape: the
published configs name it ``global_head_dim`` and ``num_global_key_value_heads`` (the latter only
counts where ``attention_k_eq_v``), transformers 5.24 re-saves it as ``per_layer_config`` (one
override per full layer). Each layer type has its RoPE (``default``, or ``proportional``: the
first ``partial_rotary_factor`` of each half rotated, the frequencies over the whole head).
The optional parts are the MoE block beside the dense MLP (``enable_moe_block``), per-layer
embeddings (``hidden_size_per_layer_input``), a tail of layers reusing an earlier layer's keys and
values (``num_kv_shared_layers``) whose MLPs may be twice as wide (``use_double_wide_mlp``).

The layers form groups of one shape each (:data:`GROUPS`): sliding or full, owning keys and values
or sharing another layer's; each group's HF layers are a config field (``sliding_layers``, ...)
the mapping's rules index by."""

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
    OBJECT,
    POSITIVE,
    VOCAB,
    WINDOW,
    Choice,
    Fields,
    Float,
    Int,
    padding_idx,
    require,
)
from otfload.config.fields import MAX_FACTOR
from otfload.config.layer_types import FULL, SLIDING, layer_types
from otfload.config.rope import THETA
from otfload.errors import ConfigError
from otfload.families.gqa_shape import attention_shape

# transformers' activation name -> whether GELU uses the tanh approximation.
_GELU_APPROXIMATE = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu_fast": True, "gelu": False}
ACTIVATIONS = Choice(*_GELU_APPROXIMATE)
SOFTCAP = Float(0.0, MAX_FACTOR, exclusive_min=True)
FRACTION = Float(0.0, 1.0, exclusive_min=True)
# RoPE kinds Gemma 4's rotary embedding is built with here.
DEFAULT, PROPORTIONAL = "default", "proportional"
ROPE_TYPES = Choice(DEFAULT, PROPORTIONAL)
# use_bidirectional_attention: "vision" makes image tokens see each other, text stays causal (no
# image is ever fed: the vision tower is not loaded); "all" makes every layer bidirectional.
BIDIRECTIONAL = Choice("vision", "all")
GEMMA4_PAD_ID = 0
# transformers' Gemma4TextConfig defaults.
DEFAULT_ROPES = {SLIDING: (1e4, 1.0, 1.0), FULL: (1e6, 0.25, 1.0)}
DEFAULT_GLOBAL_HEAD_DIM = 512
FULL_EVERY = 6

# Layer groups, each of one shape: (group name, layer type, shares another layer's keys/values).
GROUPS = (("sliding_layers", SLIDING, False), ("full_layers", FULL, False),
          ("shared_sliding_layers", SLIDING, True), ("shared_full_layers", FULL, True))
# A layer type's RoPE: (theta, rotated fraction of each half, factor dividing the frequencies).
RopeSpec = tuple[float, float, float]


def _rope(params: Fields | None, layer_type: str) -> RopeSpec:
    default = DEFAULT_ROPES[layer_type]
    if params is None:
        return default
    kind = params.get("rope_type", ROPE_TYPES, DEFAULT)
    theta = params.get("rope_theta", THETA, default[0])
    if kind == DEFAULT:  # transformers' default RoPE for Gemma 4 reads neither field
        return theta, 1.0, 1.0
    return theta, params.get("partial_rotary_factor", FRACTION, 1.0), params.get("factor", POSITIVE, 1.0)


def _ropes(f: Fields) -> dict[str, RopeSpec]:
    params = f.object("rope_parameters")
    if params is None:
        return dict(DEFAULT_ROPES)
    unknown = sorted(set(params.data) - {SLIDING, FULL})
    if unknown:
        raise ConfigError(params.name(unknown[0]), params.data[unknown[0]],
                          f"is no layer type: Gemma 4 has one RoPE per layer type ({SLIDING!r}, {FULL!r})")
    return {t: _rope(params.object(t), t) for t in (SLIDING, FULL)}


def _global_shape(f: Fields, types: tuple[str, ...], head_dim: int, kv_heads: int, k_eq_v: bool) -> tuple[int, int]:
    """``(head_dim, kv heads)`` of the full layers, from ``per_layer_config`` (transformers 5.24's
    re-saved configs) or ``global_head_dim`` / ``num_global_key_value_heads`` (the published ones)."""
    per_layer = f.get("per_layer_config", OBJECT, None)
    if per_layer is None:
        global_kv = f.get("num_global_key_value_heads", HEADS, None)
        global_head_dim = f.get("global_head_dim", HEAD_DIM, DEFAULT_GLOBAL_HEAD_DIM)
        return global_head_dim, global_kv if k_eq_v and global_kv else kv_heads
    full = {str(i) for i, t in enumerate(types) if t == FULL}
    values = [per_layer.get(k) for k in sorted(full)]
    same = all(v == values[0] for v in values) and isinstance(values[0], Mapping)
    if set(per_layer) != full or not same or not set(values[0]) <= {"head_dim", "num_key_value_heads"}:
        raise ConfigError(f.name("per_layer_config"), dict(per_layer),
                          "must override head_dim (and num_key_value_heads) alike on every full_attention layer "
                          "and on no other")
    entry = Fields(values[0], f.name("per_layer_config"))
    return entry.get("head_dim", HEAD_DIM, head_dim), entry.get("num_key_value_heads", HEADS, kv_heads)


def _kv_sharing(f: Fields, types: tuple[str, ...]) -> tuple[int, ...]:
    """Each layer's source of keys and values: itself, or (in the last ``num_kv_shared_layers``) the
    last earlier layer of its type that computes its own (transformers' ``kv_sharing_modes``)."""
    n = len(types)
    shared = f.get("num_kv_shared_layers", Int(0, n - 1), 0)
    first = n - shared
    own = types[:first]
    for t in set(types[first:]):
        require(t in own, f.name("num_kv_shared_layers"), shared,
                f"leaves no earlier {t} layer to share keys and values with")
    return tuple(i if i < first else max(j for j in range(first) if types[j] == t) for i, t in enumerate(types))


@dataclass(frozen=True)
class Gemma4Config:
    """A Gemma 4 text config as the model uses it, under the config's names (``to_dict()`` feeds the
    mapping's hooks and indices). ``kv_source[i]`` is the layer whose keys and values layer ``i``
    attends with (itself unless shared); ``num_experts`` is 0 without the MoE block."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    global_head_dim: int
    num_global_key_value_heads: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    sliding_window: int
    layer_types: tuple[str, ...]
    rope_sliding: RopeSpec
    rope_full: RopeSpec
    gelu_approximate: bool
    final_softcap: float | None
    attention_k_eq_v: bool
    kv_source: tuple[int, ...]
    use_double_wide_mlp: bool
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    pad_token_id: int | None
    sliding_layers: tuple[int, ...]
    full_layers: tuple[int, ...]
    shared_sliding_layers: tuple[int, ...]
    shared_full_layers: tuple[int, ...]

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> Gemma4Config:
        """Parse and check ``config.json`` (absent fields take transformers' Gemma 4 defaults)."""
        f = Fields(hf)
        hidden, heads, kv_heads, head_dim = attention_shape(f)
        f.get("hidden_activation", ACTIVATIONS, "gelu_pytorch_tanh")
        if f.get("attention_bias", BOOL, False):
            raise ConfigError("attention_bias", True, "Gemma 4 attention biases are not supported")
        if f.get("use_bidirectional_attention", BIDIRECTIONAL, None) == "all":
            raise ConfigError("use_bidirectional_attention", "all", "bidirectional text attention is not supported")
        n = f.get("num_hidden_layers", LAYERS)
        types = layer_types(f, n, lambda: [SLIDING if (i + 1) % FULL_EVERY else FULL for i in range(n)])
        types = (*types[:-1], FULL)  # transformers makes the last layer full whatever the list says
        k_eq_v = f.get("attention_k_eq_v", BOOL, False)
        global_head_dim, global_kv = _global_shape(f, types, head_dim, kv_heads, k_eq_v)
        require(global_head_dim % 2 == 0, "global_head_dim", global_head_dim, "must be even: RoPE rotates pairs")
        require(heads % global_kv == 0, "num_global_key_value_heads", global_kv,
                f"must divide num_attention_heads ({heads})")
        kv_source = _kv_sharing(f, types)
        moe = f.get("enable_moe_block", BOOL, False)
        experts = f.get("num_experts", EXPERTS) if moe else 0
        ple = f.get("hidden_size_per_layer_input", Int(0, 1 << 16), 256)
        vocab = f.get("vocab_size", VOCAB)
        ropes = _ropes(f)

        def group(layer_type: str, shared: bool) -> tuple[int, ...]:
            return tuple(i for i, t in enumerate(types) if t == layer_type and (kv_source[i] != i) == shared)

        return cls(
            model_type=f.get("model_type", NAME),
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            num_hidden_layers=n,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            global_head_dim=global_head_dim,
            num_global_key_value_heads=global_kv,
            rms_norm_eps=f.get("rms_norm_eps", EPS, 1e-6),
            tie_word_embeddings=f.get("tie_word_embeddings", BOOL, True),
            sliding_window=f.get("sliding_window", WINDOW, 512),
            layer_types=types,
            rope_sliding=ropes[SLIDING],
            rope_full=ropes[FULL],
            gelu_approximate=_GELU_APPROXIMATE[f.get("hidden_activation", ACTIVATIONS, "gelu_pytorch_tanh")],
            final_softcap=f.nullable("final_logit_softcapping", SOFTCAP, None),
            attention_k_eq_v=k_eq_v,
            kv_source=kv_source,
            use_double_wide_mlp=f.get("use_double_wide_mlp", BOOL, False),
            num_experts=experts,
            top_k_experts=f.get("top_k_experts", Int(1, experts)) if moe else 0,
            moe_intermediate_size=f.get("moe_intermediate_size", INTERMEDIATE) if moe else 0,
            hidden_size_per_layer_input=ple,
            vocab_size_per_layer_input=f.get("vocab_size_per_layer_input", VOCAB, 262_144) if ple else 0,
            pad_token_id=padding_idx(f, vocab, GEMMA4_PAD_ID),
            **{name: group(t, shared) for name, t, shared in GROUPS},
        )

    def to_dict(self) -> dict[str, Any]:
        """Field name → value, for the mapping table's hooks and indices."""
        return dataclasses.asdict(self)
