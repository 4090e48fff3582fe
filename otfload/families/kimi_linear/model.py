"""Flax NNX decoder for Kimi-Linear, mirroring transformers 5.24's ``KimiLinearModel``: pre-norm
layers whose mixer is Kimi Delta Attention (:mod:`otfload.models.kimi_delta`) or multi-head latent
attention without a rotary embedding (:mod:`otfload.models.mla`), then a dense SwiGLU MLP or
DeepSeek's routed plus shared experts (:mod:`otfload.models.deepseek_moe`).

Each (mixer, feed-forward) pair is a group of its own shapes, named by the config field listing its
HF layers, run in HF layer order by :func:`otfload.models.groups.run_groups`. The cache holds the MLA
layers' latent rows and, per KDA layer, the convolutions' last inputs and the recurrent state.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.kimi_linear.config import KimiLinearConfig
from otfload.models.attention import Context, token_mask
from otfload.models.base import Cache, CacheLayout, CausalLM, GroupCache, GroupCaches
from otfload.models.deepseek_moe import DeepseekMoe, FfnDims, deepseek_moe_forward
from otfload.models.groups import run_groups
from otfload.models.kimi_delta import KimiDeltaAttention, kda_conv_dim, kda_forward
from otfload.models.layers import Dense, Embed, Norm, ParamOptions, Params, rms_norm, rope_tables
from otfload.models.mla import MlaRope, MLAttention, cache_key_dim, mla_forward
from otfload.models.mlp import Mlp, swiglu


class KimiLinearLayer(nnx.Module):
    """One layer's parameters: a KDA (``kda``) or MLA (``attn``) mixer, a dense (``mlp``) or MoE
    (``moe``) feed-forward (``stack=L``: L layers of one kind on a leading axis)."""

    def __init__(
        self, cfg: KimiLinearConfig, kda: bool, moe: bool, *, dtype: DTypeLike, rngs: nnx.Rngs | None,
        stack: int | None = None,
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.input_norm = Norm(cfg.hidden_size, **kw)
        if kda:
            self.kda = KimiDeltaAttention(cfg, **kw)
        else:
            self.attn = MLAttention(cfg, **kw)
        self.post_attn_norm = Norm(cfg.hidden_size, **kw)
        if moe:
            self.moe = DeepseekMoe(cfg, **kw)
        else:
            self.mlp = Mlp(FfnDims(cfg.hidden_size, cfg.intermediate_size), **kw)


def no_rope(cfg: KimiLinearConfig, positions: jax.Array) -> MlaRope:
    """The identity rotation (``cos = 1``, ``sin = 0``) and the softmax scale ``qk_head_dim ** -0.5``:
    Kimi-Linear's MLA keeps a "rotary" key part it never rotates."""
    cos, sin = rope_tables(positions, np.zeros(cfg.qk_rope_head_dim // 2))
    return cos, sin, cfg.qk_head_dim**-0.5


def layer_forward(
    p: Params, x: jax.Array, cfg: KimiLinearConfig, rope: MlaRope, ctx: Context, cache: GroupCache | None
) -> tuple[jax.Array, GroupCache | None]:
    """One decoder layer of any kind (its params say which): ``(x, updated cache)``."""
    h = rms_norm(x, p["input_norm"]["scale"], cfg.rms_norm_eps)
    if "kda" in p:
        out, cache = kda_forward(p["kda"], h, cfg, token_mask(ctx, x.shape[1]), cache)
    else:
        out, cache = mla_forward(p["attn"], h, cfg, rope, ctx, cache)
    x = x + out
    h = rms_norm(x, p["post_attn_norm"]["scale"], cfg.rms_norm_eps)
    return x + (deepseek_moe_forward(p["moe"], h, cfg, ctx.moe_impl) if "moe" in p else swiglu(p["mlp"], h)), cache


class KimiLinearForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for Kimi-Linear: one attribute
    per layer group (a stacked :class:`KimiLinearLayer` with ``scan_layers``, else an ``nnx.List``)."""

    cfg: KimiLinearConfig
    packs_sequences = False  # KDA layers: a recurrent state along the row

    def __init__(
        self, cfg: KimiLinearConfig, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs | None,
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        for group, kda, moe in cfg.groups():
            n = len(getattr(cfg, group))
            if scan_layers:
                setattr(self, group, KimiLinearLayer(cfg, kda, moe, dtype=dtype, rngs=rngs, stack=n))
            else:
                setattr(self, group, nnx.List([KimiLinearLayer(cfg, kda, moe, dtype=dtype, rngs=rngs)
                                               for _ in range(n)]))
        self.final_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype=dtype, rngs=rngs)

    def cache_layout(self) -> dict[str, CacheLayout]:
        """One latent row per token of each MLA layer (values read from it)."""
        return {group: (len(getattr(self.cfg, group)), 1, cache_key_dim(self.cfg), 0)
                for group, kda, _ in self.cfg.groups() if not kda}

    def init_cache(self, batch: int, slots: int, dtype: DTypeLike | None = None) -> Cache:
        """The MLA layers' latent cache, and per KDA layer ``conv [b, 3 H d, K]`` (in the cache's
        dtype) and ``state [b, H, d, d]`` (float32), as transformers keeps them."""
        cache = super().init_cache(batch, slots, dtype)
        cfg = self.cfg
        conv_dtype = self.embed.embedding.get_value().dtype if dtype is None else dtype
        for group, kda, _ in cfg.groups():
            n, d = len(getattr(cfg, group)), cfg.linear_head_dim
            if kda:
                cache["layers"][group] = {
                    "conv": jnp.zeros((n, batch, kda_conv_dim(cfg), cfg.linear_conv_kernel_dim), conv_dtype),
                    "state": jnp.zeros((n, batch, cfg.linear_num_heads, d, d), jnp.float32),
                }
        return cache

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        rope = no_rope(cfg, ctx.positions)
        groups = {group: getattr(self, group) for group, _, _ in cfg.groups()}

        def layer(group: str, p: Params, h: jax.Array, c: GroupCache | None) -> tuple[jax.Array, GroupCache | None]:
            return layer_forward(p, h, cfg, rope, ctx, c)

        x, new = run_groups(groups, cfg.layer_order(), x, caches, layer)
        return rms_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps), new
