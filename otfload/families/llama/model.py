"""Reference Flax NNX decoder for the Llama family: Llama 3, Mistral, Qwen2 (qkv bias) and Qwen3
(q/k RMSNorm). GQA, RoPE (incl. Llama 3 scaling), SwiGLU, RMSNorm, tied or untied embeddings,
and ``scan_layers`` (parameters stacked on a leading ``layers`` axis, run with ``jax.lax.scan``).
Kernels keep HF's ``[out, in]`` orientation (output dims first), so loading copies and reshapes only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.llama.config import HeadShape, LlamaConfig
from otfload.models.attention import Context, Window, self_attention
from otfload.models.base import CacheLayout, CausalLM, GroupCache, GroupCaches, group_cache
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
    rope_attention_factor,
    rope_inv_freq,
    rope_tables,
    run_layers,
)

Rope = tuple[jax.Array, jax.Array]


class LayerShape(HeadShape, Protocol):
    """The config fields :class:`Attention` and :class:`Mlp` read (Gemma's config has them too)."""

    @property
    def intermediate_size(self) -> int: ...
    @property
    def qkv_bias(self) -> bool: ...
    @property
    def o_bias(self) -> bool: ...
    @property
    def mlp_bias(self) -> bool: ...
    @property
    def qk_norm(self) -> bool: ...


class Attention(nnx.Module):
    """q/k/v kernels ``(heads, head_dim, hidden)``, o ``(hidden, heads, head_dim)`` (HF's ``[out, in]``)."""

    sinks: nnx.Param[jax.Array]  # GPT-OSS's per-head attention sinks (set by its MoE decoder layer)

    def __init__(self, cfg: LayerShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        h, n, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        qkv_bias = (0, 1) if cfg.qkv_bias else ()
        self.q = Dense((n, d, h), ("heads", "head_dim", "embed"), bias_dims=qkv_bias, **kw)
        self.k = Dense((kv, d, h), ("kv_heads", "head_dim", "embed"), bias_dims=qkv_bias, **kw)
        self.v = Dense((kv, d, h), ("kv_heads", "head_dim", "embed"), bias_dims=qkv_bias, **kw)
        self.o = Dense((h, n, d), ("embed", "heads", "head_dim"), bias_dims=(0,) if cfg.o_bias else (), **kw)
        if cfg.qk_norm:
            self.q_norm = Norm(d, dtype=dtype, rngs=rngs, stack=stack)
            self.k_norm = Norm(d, dtype=dtype, rngs=rngs, stack=stack)


class Mlp(nnx.Module):
    """gate/up kernels ``(intermediate, hidden)``, down ``(hidden, intermediate)``."""

    def __init__(self, cfg: LayerShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        h, m = cfg.hidden_size, cfg.intermediate_size
        bias = (0,) if cfg.mlp_bias else ()
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.gate = Dense((m, h), ("mlp", "embed"), bias_dims=bias, **kw)
        self.up = Dense((m, h), ("mlp", "embed"), bias_dims=bias, **kw)
        self.down = Dense((h, m), ("embed", "mlp"), bias_dims=bias, **kw)


class DecoderLayer(nnx.Module):
    """One layer's parameters (``stack=L`` gives all L layers stacked on a leading axis)."""

    def __init__(self, cfg: LlamaConfig, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        self.input_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs, stack=stack)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, stack=stack)
        self.post_attn_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs, stack=stack)
        self.mlp = Mlp(cfg, dtype=dtype, rngs=rngs, stack=stack)


def attention_block(
    a: Params, h: jax.Array, cfg: LlamaConfig, rope: Rope, ctx: Context, cache: GroupCache | None,
    window: Window | None = None,
) -> tuple[jax.Array, GroupCache | None]:
    """Self-attention of the normed input ``h``: GQA, optional q/k norm, RoPE, optional ``sinks``;
    returns the output and the layer's updated cache."""
    q = dense(a["q"], h, "bsh,ndh->bsnd")
    k = dense(a["k"], h, "bsh,ndh->bsnd")
    v = dense(a["v"], h, "bsh,ndh->bsnd")
    if cfg.qk_norm:
        q = rms_norm(q, a["q_norm"]["scale"], cfg.rms_norm_eps)
        k = rms_norm(k, a["k_norm"]["scale"], cfg.rms_norm_eps)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out, cache = self_attention(q, k, v, ctx, cache, scale=cfg.head_dim**-0.5, window=window, sinks=a.get("sinks"))
    return dense(a["o"], out, "bsnd,hnd->bsh"), cache


def swiglu(m: Params, h: jax.Array) -> jax.Array:
    """The SwiGLU MLP ``down(silu(gate(h)) * up(h))``."""
    act = jax.nn.silu(dense(m["gate"], h, "bsh,mh->bsm")) * dense(m["up"], h, "bsh,mh->bsm")
    return dense(m["down"], act, "bsm,hm->bsh")


def layer_forward(
    p: Params,
    x: jax.Array,
    cfg: LlamaConfig,
    rope: Rope,
    ctx: Context,
    cache: GroupCache | None = None,
    window: Window | None = None,
    ffn: Callable[[Params, jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, GroupCache | None]:
    """One decoder layer as a pure function of its parameter dict ``p``: ``(x, updated cache)``;
    ``ffn(p, h)`` replaces the SwiGLU MLP of ``p["mlp"]`` (MoE layers)."""
    h = rms_norm(x, p["input_norm"]["scale"], cfg.rms_norm_eps)
    out, cache = attention_block(p["attn"], h, cfg, rope, ctx, cache, window)
    x = x + out
    h = rms_norm(x, p["post_attn_norm"]["scale"], cfg.rms_norm_eps)
    return x + (swiglu(p["mlp"], h) if ffn is None else ffn(p, h)), cache


class LlamaForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` (masks, positions and a KV
    cache as :class:`~otfload.models.base.CausalLM` describes).

    Subclasses with other kinds of layers override :meth:`init_layers` and :meth:`decode`.
    """

    cfg: LlamaConfig
    layers: nnx.Module  # one stacked decoder layer (``scan_layers``) or an ``nnx.List`` of layers

    def __init__(
        self, cfg: LlamaConfig, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.init_layers(dtype, rngs)
        self.final_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype=dtype, rngs=rngs)

    def init_layers(self, dtype: DTypeLike, rngs: nnx.Rngs | None) -> None:
        """Create ``self.layers``: one stacked :class:`DecoderLayer` (scanned) or a list of them."""
        cfg = self.cfg
        if self.scan_layers:
            self.layers = DecoderLayer(cfg, dtype=dtype, rngs=rngs, stack=cfg.num_hidden_layers)
        else:
            self.layers = nnx.List([DecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_hidden_layers)])

    def rope(self, positions: jax.Array) -> Rope:
        """RoPE ``(cos, sin)`` tables for ``positions`` (YaRN's attention factor folded in)."""
        cfg = self.cfg
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return rope_tables(positions, inv_freq, rope_attention_factor(cfg.rope_scaling))

    def decode(
        self, x: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        """Run every decoder layer on the embedded tokens ``x [batch, seq, hidden]``."""
        cfg = self.cfg
        rope = self.rope(ctx.positions)
        layers = self.layers
        params = [pure(layer) for layer in layers] if isinstance(layers, nnx.List) else pure(layers)
        x, cache = run_layers(params, x, lambda p, h, c: layer_forward(p, h, cfg, rope, ctx, c, cfg.sliding_window),
                              group_cache(caches, "layers"))
        return x, None if caches is None else {"layers": cache}

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        return {"layers": (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)}

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        x, new = self.decode(self.embed_tokens(input_ids), ctx, caches)
        return rms_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps), new
