"""Reference Flax NNX decoder for Gemma 2 and Gemma 3 (text): RMSNorm scaled by ``(1 + w)``,
embeddings × √hidden, norms before and after both attention and MLP, GeGLU, attention and final
logit soft-capping (Gemma 2), q/k norm (Gemma 3) and a per-layer sliding/global attention pattern
with its own RoPE per layer type.

With ``scan_layers`` every layer's parameters sit in one stack (the layers are homogeneous in
shape); the per-layer attention type is scanned over as data beside them.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from otfload.config.layer_types import SLIDING
from otfload.families.gemma.config import GemmaConfig
from otfload.models.attention import Context, Window, self_attention
from otfload.models.base import GroupCache, GroupCaches, StackedDecoderLM, group_cache
from otfload.models.gqa import Attention
from otfload.models.layers import (
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
from otfload.models.mlp import Mlp


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


class GemmaForCausalLM(StackedDecoderLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for Gemma 2 and Gemma 3 text."""

    cfg: GemmaConfig
    layer_class = GemmaDecoderLayer

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
