"""The decoder of the Gated DeltaNet hybrids (Qwen3.5, Qwen3-Next), mirroring transformers 5.24's
``Qwen3_5TextModel`` and ``Qwen3NextModel``: pre-norm layers (RMSNorms scaled by ``1 + w``) whose
mixer is a Gated DeltaNet (:mod:`otfload.models.gated_delta`) or gated full attention
(:mod:`otfload.models.gated_attention`), then a SwiGLU MLP, or routed experts plus a shared expert
gated by ``sigmoid(shared_gate(h))``.

Each kind of layer (:class:`LayerKind`: its mixer and its feed-forward) is a group of its own shapes,
named by the config field that lists its HF layers (the list the mapping indexes by), run in HF
layer order by :func:`otfload.models.groups.run_groups`. The cache holds the attention groups' keys
and values and, per linear layer, the convolution's last inputs and the recurrent state.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.attention import Context, token_mask
from otfload.models.base import Cache, CacheLayout, CausalLM, GroupCache, GroupCaches
from otfload.models.gated_attention import GatedAttention, gated_attention
from otfload.models.gated_delta import GatedDeltaNet, GatedDeltaShape, gated_delta_forward
from otfload.models.gqa import Rope, gqa_rope
from otfload.models.groups import run_groups
from otfload.models.layers import Dense, Embed, Norm, ParamOptions, Params, dense, rms_norm
from otfload.models.mlp import Mlp, swiglu
from otfload.models.moe import MoeShape, SparseMoe, moe_forward


@dataclass(frozen=True)
class LayerKind:
    """One group of layers: ``group`` is the config field listing its HF layers (also the model's
    attribute and the cache's group); ``linear`` a Gated DeltaNet mixer (else gated attention);
    ``moe`` routed plus shared experts (else a dense MLP)."""

    group: str
    linear: bool
    moe: bool


class HybridShape(GatedDeltaShape, MoeShape, Protocol):
    """The config fields the hybrid decoder reads, and its layer kinds."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def mlp_bias(self) -> bool: ...
    @property
    def shared_expert_intermediate_size(self) -> int: ...
    @property
    def rotary_dim(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def pad_token_id(self) -> int | None: ...
    @property
    def conv_dim(self) -> int: ...
    @property
    def qkvz_per_key_head(self) -> bool: ...

    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """The kinds that have layers, each listing them in the config field it names."""
        ...


def layer_order(cfg: HybridShape) -> tuple[str, ...]:
    """Each HF layer's group, in layer order."""
    group_of = {layer: kind.group for kind in cfg.layer_kinds() for layer in getattr(cfg, kind.group)}
    return tuple(group_of[layer] for layer in sorted(group_of))


@dataclass(frozen=True)
class MlpDims:
    """The :class:`~otfload.models.mlp.MlpShape` of an MLP of another width (the shared expert)."""

    hidden_size: int
    intermediate_size: int
    mlp_bias: bool = False


class HybridLayer(nnx.Module):
    """One layer's parameters of ``kind`` (``stack=L``: L layers of that kind on a leading axis)."""

    def __init__(
        self, cfg: HybridShape, kind: LayerKind, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.input_norm = Norm(cfg.hidden_size, **kw)
        if kind.linear:
            self.linear_attn = GatedDeltaNet(cfg, per_key_head=cfg.qkvz_per_key_head, **kw)
        else:
            self.attn = GatedAttention(cfg, **kw)
        self.post_attn_norm = Norm(cfg.hidden_size, **kw)
        if kind.moe:
            self.moe = SparseMoe(cfg, **kw)
            self.shared = Mlp(MlpDims(cfg.hidden_size, cfg.shared_expert_intermediate_size), **kw)
            self.shared_gate = Dense((1, cfg.hidden_size), (None, "embed"), **kw)
        else:
            self.mlp = Mlp(cfg, **kw)


def layer_forward(
    p: Params, x: jax.Array, cfg: HybridShape, rope: Rope, ctx: Context, cache: GroupCache | None
) -> tuple[jax.Array, GroupCache | None]:
    """One decoder layer of any kind (its params say which): ``(x, updated cache)``."""
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


class HybridForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]``: one attribute per layer kind
    (a stacked :class:`HybridLayer` with ``scan_layers``, else an ``nnx.List`` of them)."""

    cfg: HybridShape
    packs_sequences = False  # Gated DeltaNet layers: a recurrent state along the row

    def __init__(
        self, cfg: HybridShape, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        for kind in cfg.layer_kinds():
            n = len(getattr(cfg, kind.group))
            if scan_layers:
                setattr(self, kind.group, HybridLayer(cfg, kind, dtype=dtype, rngs=rngs, stack=n))
            else:
                setattr(self, kind.group, nnx.List([HybridLayer(cfg, kind, dtype=dtype, rngs=rngs) for _ in range(n)]))
        self.final_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype=dtype, rngs=rngs)

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        return {kind.group: (len(getattr(cfg, kind.group)), cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
                for kind in cfg.layer_kinds() if not kind.linear}

    def init_cache(self, batch: int, slots: int, dtype: DTypeLike | None = None) -> Cache:
        """The KV cache of the attention layers, and per linear layer ``conv [b, conv_dim, K]`` (in the
        cache's dtype) and ``state [b, hv, dk, dv]`` (float32), as transformers keeps them."""
        cache = super().init_cache(batch, slots, dtype)
        cfg = self.cfg
        conv_dtype = self.embed.embedding.get_value().dtype if dtype is None else dtype
        for kind in cfg.layer_kinds():
            n = len(getattr(cfg, kind.group))
            if kind.linear:
                cache["layers"][kind.group] = {
                    "conv": jnp.zeros((n, batch, cfg.conv_dim, cfg.linear_conv_kernel_dim), conv_dtype),
                    "state": jnp.zeros((n, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                                        cfg.linear_value_head_dim), jnp.float32),
                }
        return cache

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        rope = gqa_rope(ctx.positions, cfg.rotary_dim, cfg.rope_theta, None)
        groups = {kind.group: getattr(self, kind.group) for kind in cfg.layer_kinds()}

        def layer(group: str, p: Params, h: jax.Array, c: GroupCache | None) -> tuple[jax.Array, GroupCache | None]:
            return layer_forward(p, h, cfg, rope, ctx, c)

        x, new = run_groups(groups, layer_order(cfg), x, caches, layer)
        return rms_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps, offset=1.0), new
