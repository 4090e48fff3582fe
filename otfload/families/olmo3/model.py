"""Flax NNX decoder for OLMo 3: GQA attention whose q/k norms span the whole projections
(:data:`~otfload.models.gqa.WHOLE`), norms *after* attention and after the SwiGLU MLP (each output
normed before its residual add, no input norm; every norm scales in float32 before its cast back, as
OLMo's does), and sliding or full attention per layer (``layer_types``), each type with its own RoPE.

With ``scan_layers`` every layer sits in one stack (the two types share their shapes); each layer's
type is scanned over as data beside it.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from otfload.config.layer_types import SLIDING
from otfload.families.olmo3.config import Olmo3Config
from otfload.models.attention import Context, Window
from otfload.models.base import GroupCache, GroupCaches, StackedDecoderLM, group_cache
from otfload.models.gqa import WHOLE, Attention, Rope, attention_block, gqa_rope
from otfload.models.layers import (
    Norm,
    ParamOptions,
    Params,
    pure,
    rms_norm_scaled_f32,
    run_layers,
)
from otfload.models.mlp import Mlp, swiglu


class Olmo3DecoderLayer(nnx.Module):
    """One layer's parameters (``stack=L`` gives all L layers stacked on a leading axis)."""

    def __init__(self, cfg: Olmo3Config, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.attn = Attention(cfg, qk_norm_over=WHOLE, **kw)
        self.post_attn_norm = Norm(cfg.hidden_size, **kw)
        self.mlp = Mlp(cfg, **kw)
        self.post_ffw_norm = Norm(cfg.hidden_size, **kw)


def layer_forward(
    p: Params, x: jax.Array, cfg: Olmo3Config, rope: Rope, ctx: Context, cache: GroupCache | None, window: Window
) -> tuple[jax.Array, GroupCache | None]:
    """One post-norm decoder layer as a pure function of its parameters ``p``: ``(x, updated cache)``."""
    out, cache = attention_block(p["attn"], x, cfg, rope, ctx, cache, window, rms_norm_scaled_f32)
    x = x + rms_norm_scaled_f32(out, p["post_attn_norm"]["scale"], cfg.rms_norm_eps)
    return x + rms_norm_scaled_f32(swiglu(p["mlp"], x), p["post_ffw_norm"]["scale"], cfg.rms_norm_eps), cache


class Olmo3ForCausalLM(StackedDecoderLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for OLMo 3."""

    cfg: Olmo3Config
    layer_class = Olmo3DecoderLayer

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        sliding = gqa_rope(ctx.positions, cfg.head_dim, *cfg.rope_sliding)
        full = gqa_rope(ctx.positions, cfg.head_dim, *cfg.rope_full)
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
        x, cache = run_layers(params, self.embed_tokens(input_ids), run_layer,
                              (flags, windows, group_cache(caches, "layers")))
        x = rms_norm_scaled_f32(x, self.final_norm.scale[...], cfg.rms_norm_eps)
        return x, None if caches is None else {"layers": cache}
