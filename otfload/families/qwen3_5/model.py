"""Flax NNX decoder for Qwen3.5's text model, mirroring transformers 5.24's ``Qwen3_5TextModel`` and
``Qwen3_5MoeTextModel``: pre-norm layers (RMSNorms scaled by ``1 + w``) whose mixer is a Gated
DeltaNet (:mod:`otfload.models.gated_delta`) or gated full attention
(:mod:`otfload.models.gated_attention`), then a SwiGLU MLP, or routed experts plus a shared expert
gated by ``sigmoid(shared_gate(h))``.

The two kinds of layer are groups of their own shapes (``linear_layers``, ``attention_layers``);
with ``scan_layers`` each group is one stack, run in HF layer order one run of consecutive layers
of a kind at a time. The cache holds the attention layers' keys and values and, per linear layer,
the convolution's last inputs and the recurrent state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.qwen3_5.config import Qwen35Config
from otfload.models.attention import Context, token_mask
from otfload.models.base import Cache, CacheLayout, CausalLM, GroupCache, GroupCaches
from otfload.models.gated_attention import GatedAttention, gated_attention
from otfload.models.gated_delta import GatedDeltaNet, gated_delta_forward
from otfload.models.gqa import Rope, gqa_rope
from otfload.models.layers import Dense, Embed, Norm, ParamOptions, Params, dense, pure, rms_norm, run_layers
from otfload.models.mlp import Mlp, swiglu
from otfload.models.moe import SparseMoe, moe_forward

LINEAR_GROUP, ATTENTION_GROUP = "linear_layers", "attention_layers"
GROUPS = (LINEAR_GROUP, ATTENTION_GROUP)


@dataclass(frozen=True)
class MlpDims:
    """The :class:`~otfload.models.mlp.MlpShape` of an MLP of another width (the shared expert)."""

    hidden_size: int
    intermediate_size: int
    mlp_bias: bool = False


class Qwen35Layer(nnx.Module):
    """One layer's parameters, a linear (Gated DeltaNet) or an attention layer (``stack=L``: L layers
    of one kind on a leading axis)."""

    def __init__(
        self, cfg: Qwen35Config, linear: bool, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.input_norm = Norm(cfg.hidden_size, **kw)
        if linear:
            self.linear_attn = GatedDeltaNet(cfg, **kw)
        else:
            self.attn = GatedAttention(cfg, **kw)
        self.post_attn_norm = Norm(cfg.hidden_size, **kw)
        if cfg.num_experts:
            self.moe = SparseMoe(cfg, **kw)
            self.shared = Mlp(MlpDims(cfg.hidden_size, cfg.shared_expert_intermediate_size), **kw)
            self.shared_gate = Dense((1, cfg.hidden_size), (None, "embed"), **kw)
        else:
            self.mlp = Mlp(cfg, **kw)


def layer_forward(
    p: Params, x: jax.Array, cfg: Qwen35Config, rope: Rope, ctx: Context, cache: GroupCache | None
) -> tuple[jax.Array, GroupCache | None]:
    """One decoder layer of either kind (its params say which): ``(x, updated cache)``."""
    eps = cfg.rms_norm_eps
    h = rms_norm(x, p["input_norm"]["scale"], eps, offset=1.0)
    if "linear_attn" in p:
        out, cache = gated_delta_forward(p["linear_attn"], h, cfg, token_mask(ctx, x.shape[1]), cache)
    else:
        out, cache = gated_attention(p["attn"], h, rope, ctx, cache, eps)
    x = x + out
    h = rms_norm(x, p["post_attn_norm"]["scale"], eps, offset=1.0)
    if "moe" not in p:
        return x + swiglu(p["mlp"], h), cache
    shared = swiglu(p["shared"], h) * jax.nn.sigmoid(dense(p["shared_gate"], h, "bsh,oh->bso"))
    return x + moe_forward(p["moe"], h, cfg, ctx.moe_impl) + shared, cache


def layer_runs(cfg: Qwen35Config) -> list[tuple[str, int, int]]:
    """Runs of consecutive layers of one group, in HF layer order: ``(group, first, stop position)``."""
    runs: list[tuple[str, int, int]] = []
    for layer, kind in enumerate(cfg.layer_types):
        group = ATTENTION_GROUP if kind == "full_attention" else LINEAR_GROUP
        pos = getattr(cfg, group).index(layer)
        if runs and runs[-1][0] == group:
            runs[-1] = (group, runs[-1][1], pos + 1)
        else:
            runs.append((group, pos, pos + 1))
    return runs


class Qwen35ForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for Qwen3.5's text model."""

    cfg: Qwen35Config

    def __init__(
        self, cfg: Qwen35Config, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        for group in GROUPS:
            n, linear = len(getattr(cfg, group)), group == LINEAR_GROUP
            if n and scan_layers:
                setattr(self, group, Qwen35Layer(cfg, linear, dtype=dtype, rngs=rngs, stack=n))
            elif n:
                setattr(self, group, nnx.List([Qwen35Layer(cfg, linear, dtype=dtype, rngs=rngs) for _ in range(n)]))
        self.final_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype=dtype, rngs=rngs)

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        n = len(cfg.attention_layers)
        return {ATTENTION_GROUP: (n, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)} if n else {}

    def init_cache(self, batch: int, slots: int, dtype: DTypeLike | None = None) -> Cache:
        """The KV cache of the attention layers, and per linear layer ``conv [b, conv_dim, K]`` (in the
        cache's dtype) and ``state [b, hv, dk, dv]`` (float32), as transformers keeps them."""
        cache = super().init_cache(batch, slots, dtype)
        cfg, n = self.cfg, len(self.cfg.linear_layers)
        if n:
            conv_dtype = self.embed.embedding.get_value().dtype if dtype is None else dtype
            cache["layers"][LINEAR_GROUP] = {
                "conv": jnp.zeros((n, batch, cfg.conv_dim, cfg.linear_conv_kernel_dim), conv_dtype),
                "state": jnp.zeros((n, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                    cfg.linear_value_head_dim), jnp.float32),
            }
        return cache

    def _params(self, group: str, start: int, stop: int) -> Params | list[Params]:
        layers = getattr(self, group)
        if isinstance(layers, nnx.List):
            return [pure(layers[i]) for i in range(start, stop)]
        sliced: Params = jax.tree.map(lambda a: a[start:stop], pure(layers))
        return sliced

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        rope = gqa_rope(ctx.positions, cfg.rotary_dim, cfg.rope_theta, None)
        pieces: dict[str, list[Any]] = {}
        for group, start, stop in layer_runs(cfg):
            cache = None if caches is None else jax.tree.map(lambda a, i=start, j=stop: a[i:j], caches[group])

            def run(p: Params, h: jax.Array, c: GroupCache | None) -> tuple[jax.Array, GroupCache | None]:
                return layer_forward(p, h, cfg, rope, ctx, c)

            x, new = run_layers(self._params(group, start, stop), x, run, cache)
            pieces.setdefault(group, []).append(new)
        x = rms_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps, offset=1.0)
        if caches is None:
            return x, None
        return x, {group: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) for group, parts in pieces.items()}
