"""Reference Flax NNX decoder for Gemma 2 and Gemma 3 (text): RMSNorm scaled by ``(1 + w)``,
embeddings × √hidden, norms before and after both attention and MLP, GeGLU, attention and final
logit soft-capping (Gemma 2), q/k norm (Gemma 3) and a per-layer sliding/global attention pattern
with its own RoPE per layer type.

With ``scan_layers`` every layer's parameters sit in one stack (the layers are homogeneous in
shape); the per-layer attention type is scanned over as data beside them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

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
)
from otfload.config.fields import MAX_FACTOR
from otfload.config.rope import THETA
from otfload.errors import ConfigError
from otfload.models.attention import Context, Window, self_attention
from otfload.models.base import CacheLayout, CausalLM, GroupCache, GroupCaches, group_cache
from otfload.models.gpt_oss import FULL, LAYER_TYPES, SLIDING  # transformers' layer_types names, defined once
from otfload.models.layers import (
    Dense,
    Embed,
    Norm,
    ParamOptions,
    Params,
    apply_rope,
    dense,
    pure,
    rms_norm,
    rope_inv_freq,
    rope_tables,
    run_layers,
)
from otfload.models.llama import Attention, Mlp, rope_params

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


def _layer_types(f: Fields, model_type: str, num_layers: int) -> tuple[str, ...]:
    """Each layer's attention type; without ``layer_types``, every ``pattern``-th layer is global."""
    types: tuple[str, ...] | None = f.get("layer_types", LAYER_TYPES, None)
    if types is None:
        default = 2 if model_type == "gemma2" else 6
        _, pattern = f.first(("sliding_window_pattern", "_sliding_window_pattern"), LAYERS, default)
        types = tuple(SLIDING if (i + 1) % pattern else FULL for i in range(num_layers))
    require(len(types) == num_layers, f.name("layer_types"), list(types),
            f"must list one type per layer (num_hidden_layers = {num_layers})")
    return types


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma 2 / Gemma 3 text config. Field names shared with :class:`LlamaConfig` let the Llama
    attention and MLP parameter modules (and mapping rules) serve Gemma unchanged."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
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
        num_layers = f.get("num_hidden_layers", LAYERS)
        bias = f.get("attention_bias", BOOL, False)
        return cls(
            model_type=model_type,
            vocab_size=f.get("vocab_size", VOCAB),
            hidden_size=f.get("hidden_size", HIDDEN),
            intermediate_size=f.get("intermediate_size", INTERMEDIATE),
            num_layers=num_layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=f.get("rms_norm_eps", EPS, 1e-6),
            tie_word_embeddings=f.get("tie_word_embeddings", BOOL, True),
            query_pre_attn_scalar=f.get("query_pre_attn_scalar", POSITIVE, 256.0),
            sliding_window=f.nullable("sliding_window", WINDOW, 4096),
            layer_types=_layer_types(f, model_type, num_layers),
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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class GemmaDecoderLayer(nnx.Module):
    """One layer's parameters (``stack=L`` gives all L layers stacked on a leading axis)."""

    def __init__(self, cfg: GemmaConfig, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        h = cfg.hidden_size
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.input_norm = Norm(h, **kw)
        self.attn = Attention(cfg, **kw)
        self.post_attn_norm = Norm(h, **kw)
        self.pre_ffw_norm = Norm(h, **kw)
        self.mlp = Mlp(cfg, **kw)
        self.post_ffw_norm = Norm(h, **kw)


def gemma_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: normalise and multiply by ``1 + scale`` both in float32, then cast back
    (Llama casts before the multiply)."""
    return rms_norm(x.astype(jnp.float32), scale, eps, offset=1.0).astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


def layer_forward(
    p: Params, x: jax.Array, cfg: GemmaConfig, rope: tuple[jax.Array, jax.Array], ctx: Context,
    cache: GroupCache | None, window: Window,
) -> tuple[jax.Array, GroupCache | None]:
    """One decoder layer as a pure function of its parameter dict ``p``: ``(x, updated cache)``;
    ``rope`` is ``(cos, sin)`` and ``window`` the sliding window (0: global) of this layer's type."""
    a, m, eps = p["attn"], p["mlp"], cfg.rms_norm_eps
    h = gemma_norm(x, p["input_norm"]["scale"], eps)
    q = dense(a["q"], h, "bsh,ndh->bsnd")
    k = dense(a["k"], h, "bsh,ndh->bsnd")
    v = dense(a["v"], h, "bsh,ndh->bsnd")
    if cfg.qk_norm:
        q = gemma_norm(q, a["q_norm"]["scale"], eps)
        k = gemma_norm(k, a["k_norm"]["scale"], eps)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out, cache = self_attention(q, k, v, ctx, cache, scale=cfg.query_pre_attn_scalar**-0.5, window=window,
                                softcap=cfg.attn_softcap)
    x = x + gemma_norm(dense(a["o"], out, "bsnd,hnd->bsh"), p["post_attn_norm"]["scale"], eps)
    h = gemma_norm(x, p["pre_ffw_norm"]["scale"], eps)
    gate = jax.nn.gelu(dense(m["gate"], h, "bsh,mh->bsm"), approximate=cfg.gelu_approximate)
    out = dense(m["down"], gate * dense(m["up"], h, "bsh,mh->bsm"), "bsm,hm->bsh")
    return x + gemma_norm(out, p["post_ffw_norm"]["scale"], eps), cache


class GemmaForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for Gemma 2 and Gemma 3 text."""

    cfg: GemmaConfig
    layers: nnx.Module  # one stacked decoder layer (``scan_layers``) or an ``nnx.List`` of layers

    def __init__(
        self, cfg: GemmaConfig, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        if scan_layers:
            self.layers = GemmaDecoderLayer(cfg, dtype=dtype, rngs=rngs, stack=cfg.num_layers)
        else:
            self.layers = nnx.List([GemmaDecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype=dtype, rngs=rngs)

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        return {"layers": (cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.head_dim)}

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        # transformers multiplies by √hidden rounded to the activation dtype.
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)
        # (rope, window) of each attention type; a layer picks one with its sliding flag.
        sliding = rope_tables(ctx.positions, rope_inv_freq(cfg.head_dim, *cfg.rope_local))
        full = rope_tables(ctx.positions, rope_inv_freq(cfg.head_dim, *cfg.rope_global))
        flags = np.array([t == SLIDING for t in cfg.layer_types])
        windows = np.where(flags, cfg.sliding_window or 0, 0).astype(np.int32)

        def run_layer(
            p: Params, h: jax.Array, xs: tuple[jax.Array | np.bool_, Window, GroupCache | None]
        ) -> tuple[jax.Array, GroupCache | None]:
            is_sliding, window, cache = xs
            rope = jax.tree.map(lambda s, f: jnp.where(is_sliding, s, f), sliding, full)
            return layer_forward(p, h, cfg, rope, ctx, cache, window)

        layers = self.layers
        params = [pure(layer) for layer in layers] if isinstance(layers, nnx.List) else pure(layers)
        x, cache = run_layers(params, x, run_layer, (flags, windows, group_cache(caches, "layers")))
        x = gemma_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps)
        return x, None if caches is None else {"layers": cache}

    def head(self, x: jax.Array) -> jax.Array:
        return softcap(super().head(x), self.cfg.final_softcap)
