"""Grouped-query attention: the parameters (q/k/v/o kernels in HF's ``[out, in]`` orientation,
optional biases and q/k RMSNorms) and the block that runs them on a normed input with RoPE (Llama 3,
Mistral, Qwen2/3, Gemma's parameters, the MoE decoders, OLMo 3, GLM-4.5, MiniMax-M2).

The q/k norms are of one of two kinds (``qk_norm_over``): :data:`PER_HEAD` normalises each head's
``head_dim`` values (Qwen3, Gemma 3; scale ``(head_dim,)``), :data:`WHOLE` the whole projection,
every head at once (OLMo 3, MiniMax-M2; HF's scale ``(heads * head_dim,)`` kept as ``(heads,
head_dim)`` so it shards with the heads). Partial rotary comes from RoPE tables narrower than
``head_dim`` (:func:`~otfload.models.layers.apply_rope`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.attention import Context, Window, self_attention
from otfload.models.base import GroupCache
from otfload.models.layers import (
    Dense,
    Norm,
    ParamOptions,
    Params,
    apply_rope,
    dense,
    rms_norm,
    rope_attention_factor,
    rope_inv_freq,
    rope_tables,
)

Rope = tuple[jax.Array, jax.Array]
# An RMSNorm ``(x, scale, eps) -> normed x`` (:func:`~otfload.models.layers.rms_norm` or a variant).
NormFn = Callable[[jax.Array, jax.Array, float], jax.Array]
# What a q/k norm normalises over: each head, or the whole projection (all heads together).
PER_HEAD, WHOLE = "head", "whole"


class HeadShape(Protocol):
    """The attention shape of a Llama-style config (Gemma's has the same names)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def num_key_value_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...


class GqaShape(HeadShape, Protocol):
    """The config fields :class:`Attention` and :func:`attention_block` read."""

    @property
    def qkv_bias(self) -> bool: ...
    @property
    def o_bias(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...
    @property
    def rms_norm_eps(self) -> float: ...


class Attention(nnx.Module):
    """q/k/v kernels ``(heads, head_dim, hidden)``, o ``(hidden, heads, head_dim)`` (HF's ``[out, in]``)."""

    sinks: nnx.Param[jax.Array]  # GPT-OSS's per-head attention sinks (set by its MoE decoder layer)

    def __init__(
        self, cfg: GqaShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None,
        qk_norm_over: str = PER_HEAD,
    ) -> None:
        h, n, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        qkv_bias = (0, 1) if cfg.qkv_bias else ()
        self.q = Dense((n, d, h), ("heads", "head_dim", "embed"), bias_dims=qkv_bias, **kw)
        self.k = Dense((kv, d, h), ("kv_heads", "head_dim", "embed"), bias_dims=qkv_bias, **kw)
        self.v = Dense((kv, d, h), ("kv_heads", "head_dim", "embed"), bias_dims=qkv_bias, **kw)
        self.o = Dense((h, n, d), ("embed", "heads", "head_dim"), bias_dims=(0,) if cfg.o_bias else (), **kw)
        if cfg.qk_norm and qk_norm_over == WHOLE:
            self.q_norm = Norm((n, d), ("heads", "head_dim"), **kw)
            self.k_norm = Norm((kv, d), ("kv_heads", "head_dim"), **kw)
        elif cfg.qk_norm:
            self.q_norm = Norm(d, dtype=dtype, rngs=rngs, stack=stack)
            self.k_norm = Norm(d, dtype=dtype, rngs=rngs, stack=stack)


def qk_norm(x: jax.Array, scale: jax.Array, eps: float, norm: NormFn = rms_norm) -> jax.Array:
    """RMSNorm (``norm``) of ``x [b, s, heads, head_dim]`` per head (``scale (head_dim,)``) or over
    the whole projection (``scale (heads, head_dim)``, :data:`WHOLE`)."""
    if scale.ndim == 1:
        return norm(x, scale, eps)
    b, s, n, d = x.shape
    return norm(x.reshape(b, s, n * d), scale.reshape(n * d), eps).reshape(b, s, n, d)


def attention_block(
    a: Params, h: jax.Array, cfg: GqaShape, rope: Rope | None, ctx: Context, cache: GroupCache | None,
    window: Window | None = None, norm: NormFn = rms_norm,
) -> tuple[jax.Array, GroupCache | None]:
    """Self-attention of the normed input ``h``: GQA, optional q/k norm (either kind, by ``norm``),
    RoPE (full or partial; ``rope=None``: no position rotation, Nemotron-H), optional ``sinks``;
    returns the output and the layer's updated cache."""
    q = dense(a["q"], h, "bsh,ndh->bsnd")
    k = dense(a["k"], h, "bsh,ndh->bsnd")
    v = dense(a["v"], h, "bsh,ndh->bsnd")
    if cfg.qk_norm:
        q = qk_norm(q, a["q_norm"]["scale"], cfg.rms_norm_eps, norm)
        k = qk_norm(k, a["k_norm"]["scale"], cfg.rms_norm_eps, norm)
    if rope is not None:
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out, cache = self_attention(q, k, v, ctx, cache, scale=cfg.head_dim**-0.5, window=window, sinks=a.get("sinks"))
    return dense(a["o"], out, "bsnd,hnd->bsh"), cache


def gqa_rope(positions: jax.Array, rotary_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> Rope:
    """RoPE ``(cos, sin)`` of ``rotary_dim`` dims for ``positions`` (partial rotary when narrower than
    the heads; YaRN's attention factor folded in)."""
    return rope_tables(positions, rope_inv_freq(rotary_dim, theta, scaling), rope_attention_factor(scaling))
