"""The sparse mixture-of-experts decoder Mixtral introduced, built on the Llama family's layers;
Qwen3-MoE and GPT-OSS build theirs from it too (their packages parse their configs into a
:class:`~otfload.families.mixtral.config.MoeConfig` and map their checkpoints onto this model).

Expert weights of a layer are stacked on a leading ``experts`` axis (logical axis ``"experts"``,
sharded on ``ep`` by the default rules) in the orientation the checkpoint stores them, so loading
never transposes: ``gate``/``up`` kernels ``[E, inter, hidden]`` and ``down`` ``[E, hidden, inter]``
(per-expert HF ``[out, in]`` weights: Mixtral, Qwen3-MoE), or ``[E, hidden, inter]`` and
``[E, inter, hidden]`` with ``experts_in_first`` (GPT-OSS's fused ``[E, in, out]`` tensors).

The router picks each token's top-k experts and only those run on the token: tokens are grouped by
expert for grouped matmuls (:mod:`otfload.models.experts`; exact, no capacity limit), with the
experts split over an ``ep`` mesh axis when there is one.

Layers whose feed-forward is an MoE (``cfg.moe_layers``) and dense SwiGLU layers
(``cfg.dense_layers``) form two groups, ``layers`` and ``dense_layers``; with ``scan_layers`` each
group is one stack, run in HF layer order one homogeneous run at a time.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.llama.model import Attention, DecoderLayer, LlamaForCausalLM, layer_forward
from otfload.families.mixtral.config import CLAMPED_SWIGLU, TOPK_SOFTMAX, MoeConfig
from otfload.models.attention import Context, Window
from otfload.models.base import CacheLayout, GroupCache, GroupCaches
from otfload.models.experts import expert_ffn
from otfload.models.layers import (
    Dense,
    ExpertDense,
    Norm,
    ParamOptions,
    Params,
    dense,
    make_param,
    pure,
    run_layers,
)


class SparseMoe(nnx.Module):
    """Router ``[E, hidden]`` and the experts' ``gate``/``up``/``down`` weights."""

    def __init__(self, cfg: MoeConfig, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        h, m, e = cfg.hidden_size, cfg.moe_intermediate_size, cfg.num_experts
        self.router = Dense((e, h), (None, "embed"), bias_dims=(0,) if cfg.router_bias else (), dtype=dtype,
                            rngs=rngs, stack=stack)
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        bias, in_first = cfg.expert_bias, cfg.experts_in_first
        self.gate = ExpertDense(e, (m, h), ("mlp", "embed"), bias=bias, in_first=in_first, **kw)
        self.up = ExpertDense(e, (m, h), ("mlp", "embed"), bias=bias, in_first=in_first, **kw)
        self.down = ExpertDense(e, (h, m), ("embed", "mlp"), bias=bias, in_first=in_first, **kw)


class MoeDecoderLayer(nnx.Module):
    """A decoder layer whose feed-forward is :class:`SparseMoe` (optionally with attention sinks)."""

    def __init__(self, cfg: MoeConfig, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        self.input_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs, stack=stack)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, stack=stack)
        if cfg.attention_sinks:
            self.attn.sinks = make_param(rngs, (cfg.num_attention_heads,), ("heads",), dtype, stack)
        self.post_attn_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs, stack=stack)
        self.moe = SparseMoe(cfg, dtype=dtype, rngs=rngs, stack=stack)


def route(logits: jax.Array, cfg: MoeConfig) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts: ``(weights, idx)``, both ``[..., k]``, weights in float32."""
    logits = logits.astype(jnp.float32)
    if cfg.routing == TOPK_SOFTMAX:
        top, idx = jax.lax.top_k(logits, cfg.num_experts_per_tok)
        return jax.nn.softmax(top, axis=-1), idx
    top, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top = top / top.sum(axis=-1, keepdims=True)
    return top, idx


def expert_activation(gate: jax.Array, up: jax.Array, cfg: MoeConfig) -> jax.Array:
    """The experts' gated activation (``cfg.activation``) of their gate and up projections."""
    if cfg.activation == CLAMPED_SWIGLU:
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha)
    return jax.nn.silu(gate) * up


def moe_forward(p: Params, h: jax.Array, cfg: MoeConfig, impl: str | None = None) -> jax.Array:
    """The MoE feed-forward of ``h [batch, seq, hidden]`` from a :class:`SparseMoe` param dict:
    each token through its top-k experts only (:func:`~otfload.models.experts.expert_ffn`)."""
    flat = h.reshape(-1, h.shape[-1])
    weights, idx = route(dense(p["router"], flat, "th,eh->te"), cfg)
    experts = {name: p[name] for name in ("gate", "up", "down")}
    out = expert_ffn(flat, idx, weights, experts, in_first=cfg.experts_in_first,
                     activation=lambda g, u: expert_activation(g, u, cfg), impl=impl)
    return out.reshape(h.shape)


def layer_runs(cfg: MoeConfig) -> list[tuple[str, int, int, int]]:
    """Maximal runs of consecutive layers in one group: ``(group, first position, stop position,
    first HF layer)``, in HF layer order."""
    runs: list[tuple[str, int, int, int]] = []
    for layer in range(cfg.num_hidden_layers):
        group, ids = ("layers", cfg.moe_layers) if layer in cfg.moe_layers else ("dense_layers", cfg.dense_layers)
        pos = ids.index(layer)
        if runs and runs[-1][0] == group and runs[-1][2] == pos:
            runs[-1] = (group, runs[-1][1], pos + 1, runs[-1][3])
        else:
            runs.append((group, pos, pos + 1, layer))
    return runs


class MoeForCausalLM(LlamaForCausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for an MoE decoder."""

    cfg: MoeConfig
    dense_layers: nnx.Module  # like ``layers``, of the dense layers (absent when there are none)

    def init_layers(self, dtype: DTypeLike, rngs: nnx.Rngs | None) -> None:
        """``layers`` (the MoE layers) and, when the config has any, ``dense_layers``."""
        self.layers = self._group(MoeDecoderLayer, len(self.cfg.moe_layers), dtype, rngs)
        if self.cfg.dense_layers:
            self.dense_layers = self._group(DecoderLayer, len(self.cfg.dense_layers), dtype, rngs)

    def _group(
        self, layer_cls: type[MoeDecoderLayer] | type[DecoderLayer], n: int, dtype: DTypeLike, rngs: nnx.Rngs | None
    ) -> nnx.Module:
        if self.scan_layers:
            return layer_cls(self.cfg, dtype=dtype, rngs=rngs, stack=n)
        return nnx.List([layer_cls(self.cfg, dtype=dtype, rngs=rngs) for _ in range(n)])

    def _params(self, group: str, start: int, stop: int) -> Params | list[Params]:
        layers = self.layers if group == "layers" else self.dense_layers
        if isinstance(layers, nnx.List):
            return [pure(layers[i]) for i in range(start, stop)]
        sliced: Params = jax.tree.map(lambda a: a[start:stop], pure(layers))
        return sliced

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        shape = (cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
        layout = {"layers": (len(cfg.moe_layers), *shape)}
        if cfg.dense_layers:
            layout["dense_layers"] = (len(cfg.dense_layers), *shape)
        return layout

    def decode(
        self, x: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        rope = self.rope(ctx.positions)
        sliding = range(cfg.num_hidden_layers) if cfg.sliding_layers is None else cfg.sliding_layers
        # Each layer's window (0: full attention): a static int when all layers share it, else one
        # per layer (numpy, so unscanned layers still see a static window).
        windows = np.array([(cfg.sliding_window or 0) if i in sliding else 0 for i in range(cfg.num_hidden_layers)],
                           np.int32)
        shared = int(windows[0]) if (windows == windows[0]).all() else None

        def forward(
            p: Params, h: jax.Array, xs: tuple[Window, GroupCache | None]
        ) -> tuple[jax.Array, GroupCache | None]:
            window, cache = xs
            ffn = (lambda q, y: moe_forward(q["moe"], y, cfg, ctx.moe_impl)) if "moe" in p else None
            return layer_forward(p, h, cfg, rope, ctx, cache, window if shared is None else shared, ffn)

        pieces: dict[str, list[GroupCache | None]] = {}
        for group, start, stop, first in layer_runs(cfg):
            cache = None if caches is None else jax.tree.map(lambda a, i=start, j=stop: a[i:j], caches[group])
            xs = (windows[first : first + stop - start], cache)
            x, new = run_layers(self._params(group, start, stop), x, forward, xs)
            pieces.setdefault(group, []).append(new)
        if caches is None:
            return x, None
        return x, {group: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) for group, parts in pieces.items()}
