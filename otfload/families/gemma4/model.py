"""Flax NNX decoder for Gemma 4's text model, mirroring transformers 5.24's ``Gemma4TextModel``.

Each layer: RMSNorm (scaled by ``w``, not Gemma 2/3's ``1 + w``) before and after attention and the
feed-forward, the output times the stored ``layer_scalar`` (a buffer in transformers: no gradient
reaches it). Attention: q/k RMSNorms per head, an unscaled RMSNorm on the values, logits not divided
by √head_dim, RoPE per layer type; full layers have their own head size and kv heads, and with
``attention_k_eq_v`` no value projection (values are the unnormed keys). The feed-forward is a GeGLU
MLP, plus, with the MoE block, routed experts on the attention output beside it (its own router
norm, scales and three extra norms). Per-layer embeddings add a gated residual from a per-layer
slice of a second embedding and of a projection of the first (the second's ``pad_token_id`` row
frozen like the first's, :attr:`freeze_pad_row`). The last ``num_kv_shared_layers`` layers compute
no keys or values: they attend with the last earlier layer of their type's, cached ones included.
Logits are soft-capped.

Layers of one shape form a group (:data:`~otfload.families.gemma4.config.GROUPS`); with
``scan_layers`` each group is one stack, run in HF layer order one run of consecutive layers at a
time (a layer whose keys and values others reuse runs on its own, so they come out of it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from otfload.config.layer_types import FULL, SLIDING
from otfload.families.gemma4.config import GROUPS, Gemma4Config, RopeSpec
from otfload.models.attention import Context, attention, write_cache
from otfload.models.base import CacheLayout, CausalLM, GroupCache, GroupCaches
from otfload.models.experts import expert_ffn
from otfload.models.gqa import Rope
from otfload.models.layers import (
    Dense,
    Embed,
    ExpertDense,
    Norm,
    ParamOptions,
    Params,
    apply_rope,
    dense,
    make_param,
    pure,
    rope_inv_freq,
    rope_tables,
    run_layers,
)
from otfload.models.mlp import Mlp
from otfload.models.weights import materialize

KV = tuple[jax.Array, jax.Array]


@dataclass(frozen=True)
class MlpDims:
    """The :class:`~otfload.models.mlp.MlpShape` of one layer's MLP."""

    hidden_size: int
    intermediate_size: int
    mlp_bias: bool = False


@dataclass(frozen=True)
class Kind:
    """What a layer group's layers are: full or sliding, computing keys and values or sharing them."""

    full: bool
    shared: bool

    def head(self, cfg: Gemma4Config) -> tuple[int, int]:
        """``(kv heads, head_dim)`` of this kind's attention."""
        if self.full:
            return cfg.num_global_key_value_heads, cfg.global_head_dim
        return cfg.num_key_value_heads, cfg.head_dim


KINDS = {name: Kind(layer_type == FULL, shared) for name, layer_type, shared in GROUPS}


class Gemma4Attention(nnx.Module):
    """q ``(heads, d, hidden)`` with its per-head norm, o ``(hidden, heads, d)``; unless shared, k (and
    v unless keys are values) ``(kv heads, d, hidden)`` and the k norm."""

    def __init__(self, cfg: Gemma4Config, kind: Kind, **kw: Any) -> None:
        h, n = cfg.hidden_size, cfg.num_attention_heads
        kv, d = kind.head(cfg)
        self.q = Dense((n, d, h), ("heads", "head_dim", "embed"), **kw)
        self.q_norm = Norm(d, **kw)
        self.o = Dense((h, n, d), ("embed", "heads", "head_dim"), **kw)
        if not kind.shared:
            self.k = Dense((kv, d, h), ("kv_heads", "head_dim", "embed"), **kw)
            self.k_norm = Norm(d, **kw)
            if not (kind.full and cfg.attention_k_eq_v):
                self.v = Dense((kv, d, h), ("kv_heads", "head_dim", "embed"), **kw)


class Router(nnx.Module):
    """The router's projection ``[E, hidden]``, input scale ``[hidden]`` and per-expert output scale."""

    def __init__(self, cfg: Gemma4Config, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None) -> None:
        e, h = cfg.num_experts, cfg.hidden_size
        self.kernel = make_param(rngs, (e, h), (None, "embed"), dtype, stack)
        self.scale = make_param(rngs, (h,), ("norm",), dtype, stack)
        self.per_expert_scale = make_param(rngs, (e,), (None,), dtype, stack)


class Experts(nnx.Module):
    """Router and routed experts' GeGLU kernels ``[E, out, in]`` (HF's fused ``gate_up_proj`` split)."""

    def __init__(self, cfg: Gemma4Config, **kw: Any) -> None:
        e, h, m = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.router = Router(cfg, **kw)
        self.gate = ExpertDense(e, (m, h), ("mlp", "embed"), bias=False, **kw)
        self.up = ExpertDense(e, (m, h), ("mlp", "embed"), bias=False, **kw)
        self.down = ExpertDense(e, (h, m), ("embed", "mlp"), bias=False, **kw)


class Gemma4Layer(nnx.Module):
    """One layer's parameters (``stack=L``: L layers of one kind on a leading axis)."""

    def __init__(
        self, cfg: Gemma4Config, kind: Kind, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        h = cfg.hidden_size
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.input_norm = Norm(h, **kw)
        self.attn = Gemma4Attention(cfg, kind, **kw)
        self.post_attn_norm = Norm(h, **kw)
        self.pre_ffw_norm = Norm(h, **kw)
        wide = 2 if cfg.use_double_wide_mlp and kind.shared else 1
        self.mlp = Mlp(MlpDims(h, cfg.intermediate_size * wide), **kw)
        self.post_ffw_norm = Norm(h, **kw)
        self.layer_scalar = make_param(rngs, (1,), (None,), dtype, stack)
        if cfg.num_experts:
            self.moe = Experts(cfg, **kw)
            self.post_ffw_norm_1 = Norm(h, **kw)
            self.pre_ffw_norm_2 = Norm(h, **kw)
            self.post_ffw_norm_2 = Norm(h, **kw)
        if cfg.hidden_size_per_layer_input:
            ple = cfg.hidden_size_per_layer_input
            self.ple_gate = Dense((ple, h), (None, "embed"), **kw)
            self.ple_proj = Dense((h, ple), ("embed", None), **kw)
            self.ple_norm = Norm(h, **kw)


def norm(x: jax.Array, scale: jax.Array | None, eps: float) -> jax.Array:
    """Gemma 4's RMSNorm: normalised and scaled (when ``scale``) in float32, then cast back."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (y if scale is None else y * scale.astype(jnp.float32)).astype(x.dtype)


def rope_of(positions: jax.Array, head_dim: int, spec: RopeSpec) -> Rope:
    """``(cos, sin)`` over the whole head: transformers' ``proportional`` RoPE rotates the first
    ``fraction`` of each half's frequencies (exponents over ``head_dim``) and leaves the rest at
    frequency 0, unrotated; the default kind is fraction 1."""
    theta, fraction, factor = spec
    inv = rope_inv_freq(head_dim, theta, None)
    rotated = int(fraction * head_dim // 2)
    return rope_tables(positions, (np.where(np.arange(head_dim // 2) < rotated, inv, 0) / factor).astype(np.float32))


def gelu(x: jax.Array, cfg: Gemma4Config) -> jax.Array:
    return jax.nn.gelu(x, approximate=cfg.gelu_approximate)


def geglu(m: Params, h: jax.Array, cfg: Gemma4Config) -> jax.Array:
    act = gelu(dense(m["gate"], h, "bsh,mh->bsm"), cfg) * dense(m["up"], h, "bsh,mh->bsm")
    return dense(m["down"], act, "bsm,hm->bsh")


def moe_forward(p: Params, x: jax.Array, cfg: Gemma4Config, impl: str | None) -> jax.Array:
    """The routed experts of the residual stream ``x``: routed on its unscaled RMSNorm times the
    router's scale and hidden**-0.5 (softmax, top k, renormalised, times the chosen experts'
    ``per_expert_scale``), run on ``pre_ffw_norm_2(x)``, then ``post_ffw_norm_2``."""
    eps, r = cfg.rms_norm_eps, p["moe"]["router"]
    flat = x.reshape(-1, x.shape[-1])
    scaled = norm(flat, None, eps) * r["scale"] * jnp.asarray(cfg.hidden_size**-0.5, flat.dtype)
    probs = jax.nn.softmax(dense(r, scaled, "th,eh->te").astype(jnp.float32), axis=-1)
    weights, idx = jax.lax.top_k(probs, cfg.top_k_experts)
    weights = weights / weights.sum(-1, keepdims=True) * r["per_expert_scale"][idx].astype(jnp.float32)
    experts = {name: p["moe"][name] for name in ("gate", "up", "down")}
    out = expert_ffn(norm(flat, p["pre_ffw_norm_2"]["scale"], eps), idx, weights, experts, in_first=False,
                     activation=lambda g, u: gelu(g, cfg) * u, impl=impl)
    return norm(out.reshape(x.shape), p["post_ffw_norm_2"]["scale"], eps)


def attention_forward(
    a: Params, h: jax.Array, cfg: Gemma4Config, kind: Kind, rope: Rope, ctx: Context, cache: GroupCache | None,
    shared: KV | None,
) -> tuple[jax.Array, GroupCache | None, KV]:
    """Attention of the normed input ``h``: ``(output, updated cache, the keys and values attended
    with)``; a shared layer attends with ``shared`` (another layer's, cache slots included)."""
    eps = cfg.rms_norm_eps
    q = apply_rope(norm(dense(a["q"], h, "bsh,ndh->bsnd"), a["q_norm"]["scale"], eps), *rope)
    if shared is None:
        k = dense(a["k"], h, "bsh,ndh->bsnd")
        v = norm(dense(a["v"], h, "bsh,ndh->bsnd") if "v" in a else k, None, eps)
        k = apply_rope(norm(k, a["k_norm"]["scale"], eps), *rope)
        if cache is not None:
            cache = {"k": write_cache(cache, "k", k, ctx), "v": write_cache(cache, "v", v, ctx)}
            k, v = cache["k"], cache["v"]
    else:
        k, v = shared
    window = 0 if kind.full else cfg.sliding_window
    out = attention(q, k, v, ctx, scale=1.0, window=window)
    return dense(a["o"], out, "bsnd,hnd->bsh"), cache, (k, v)


def layer_forward(
    p: Params, x: jax.Array, cfg: Gemma4Config, kind: Kind, rope: Rope, ctx: Context, cache: GroupCache | None,
    shared: KV | None, ple: jax.Array | None,
) -> tuple[jax.Array, GroupCache | None, KV]:
    """One decoder layer: ``(x, updated cache, its keys and values)``; ``ple`` is this layer's
    per-layer input ``[b, s, ple]`` (None without per-layer embeddings)."""
    eps = cfg.rms_norm_eps
    out, cache, kv = attention_forward(p["attn"], norm(x, p["input_norm"]["scale"], eps), cfg, kind, rope, ctx,
                                       cache, shared)
    x = x + norm(out, p["post_attn_norm"]["scale"], eps)
    ffw = geglu(p["mlp"], norm(x, p["pre_ffw_norm"]["scale"], eps), cfg)
    if "moe" in p:
        ffw = norm(ffw, p["post_ffw_norm_1"]["scale"], eps) + moe_forward(p, x, cfg, ctx.moe_impl)
    x = x + norm(ffw, p["post_ffw_norm"]["scale"], eps)
    if ple is not None:
        gated = gelu(dense(p["ple_gate"], x, "bsh,ph->bsp"), cfg) * ple
        x = x + norm(dense(p["ple_proj"], gated, "bsp,hp->bsh"), p["ple_norm"]["scale"], eps)
    # transformers keeps layer_scalar as a buffer: applied, never trained.
    return x * jax.lax.stop_gradient(p["layer_scalar"]), cache, kv


def layer_runs(cfg: Gemma4Config) -> list[tuple[str, int, int, int]]:
    """Runs of consecutive layers of one group, in HF layer order: ``(group, first position, stop
    position, first HF layer)``; a layer whose keys and values later layers reuse is a run alone."""
    groups = {i: name for name, _, _ in GROUPS for i in getattr(cfg, name)}
    producers = {s for i, s in enumerate(cfg.kv_source) if s != i}
    runs: list[tuple[str, int, int, int]] = []
    for layer in range(cfg.num_hidden_layers):
        group = groups[layer]
        pos = getattr(cfg, group).index(layer)
        last = runs[-1] if runs else None
        if last and last[0] == group and last[2] == pos and last[3] not in producers and layer not in producers:
            runs[-1] = (group, last[1], pos + 1, last[3])
        else:
            runs.append((group, pos, pos + 1, layer))
    return runs


def _rows(tree: Any, start: int | None, stop: int | None) -> Any:
    """Every array of ``tree`` indexed on its leading axis: ``[start:stop]``, ``[start]`` without
    ``stop``, or with a new leading axis of one when both are None."""
    if start is None:
        return jax.tree.map(lambda a: a[None], tree)
    return jax.tree.map(lambda a: a[start] if stop is None else a[start:stop], tree)


class Gemma4ForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for Gemma 4's text model."""

    cfg: Gemma4Config

    def __init__(
        self, cfg: Gemma4Config, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        h = cfg.hidden_size
        self.embed = Embed(cfg.vocab_size, h, dtype=dtype, rngs=rngs)
        for name, kind in KINDS.items():
            n = len(getattr(cfg, name))
            if n and scan_layers:
                setattr(self, name, Gemma4Layer(cfg, kind, dtype=dtype, rngs=rngs, stack=n))
            elif n:
                setattr(self, name, nnx.List([Gemma4Layer(cfg, kind, dtype=dtype, rngs=rngs) for _ in range(n)]))
        if cfg.hidden_size_per_layer_input:
            width = cfg.num_hidden_layers * cfg.hidden_size_per_layer_input
            self.embed_per_layer = Embed(cfg.vocab_size_per_layer_input, width, dtype=dtype, rngs=rngs)
            self.ple_projection = Dense((width, h), (None, "embed"), dtype=dtype, rngs=rngs)
            self.ple_projection_norm = Norm(cfg.hidden_size_per_layer_input, dtype=dtype, rngs=rngs)
        self.init_output(cfg.vocab_size, h, dtype, rngs)

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        out: dict[str, CacheLayout] = {}
        for name, kind in KINDS.items():
            n = len(getattr(cfg, name))
            if n and not kind.shared:
                kv, d = kind.head(cfg)
                out[name] = (n, kv, d, d)
        return out

    def _params(self, group: str, start: int, stop: int) -> Params | list[Params]:
        layers = getattr(self, group)
        if isinstance(layers, nnx.List):
            return [pure(layers[i]) for i in range(start, stop)]
        sliced: Params = jax.tree.map(lambda a: a[start:stop], pure(layers))
        return sliced

    def per_layer_inputs(self, input_ids: jax.Array, x: jax.Array) -> jax.Array:
        """Each layer's per-layer input, ``[layers, b, s, ple]``: the per-layer embedding (× √ple) and
        the normed projection of the scaled embeddings ``x`` (× hidden**-0.5), summed × 2**-0.5."""
        cfg = self.cfg
        b, s = input_ids.shape
        ple, dtype = cfg.hidden_size_per_layer_input, x.dtype
        tokens = self.embed_per_layer.embedding[...][input_ids]
        if cfg.pad_token_id is not None and self.freeze_pad_row:  # as embed_tokens: padding_idx gets no gradient
            tokens = jnp.where((input_ids == cfg.pad_token_id)[..., None], jax.lax.stop_gradient(tokens), tokens)
        tokens = tokens * jnp.asarray(ple**0.5, dtype)
        projected = jnp.einsum("bsh,ph->bsp", x, self.ple_projection.kernel[...]) * jnp.asarray(
            cfg.hidden_size**-0.5, dtype)
        projected = norm(projected.reshape(b, s, -1, ple), self.ple_projection_norm.scale[...], cfg.rms_norm_eps)
        both = (projected + tokens.reshape(b, s, -1, ple)) * jnp.asarray(2**-0.5, dtype)
        return jnp.moveaxis(both, 2, 0)

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        x = x * jnp.asarray(cfg.hidden_size**0.5, x.dtype)  # √hidden rounded to the activation dtype
        ple = self.per_layer_inputs(input_ids, x) if cfg.hidden_size_per_layer_input else None
        ropes = {SLIDING: rope_of(ctx.positions, cfg.head_dim, cfg.rope_sliding),
                 FULL: rope_of(ctx.positions, cfg.global_head_dim, cfg.rope_full)}
        shared_kv: dict[int, KV] = {}
        pieces: dict[str, list[GroupCache | None]] = {}
        for group, start, stop, first in layer_runs(cfg):
            kind = KINDS[group]
            cache = None if caches is None or kind.shared else _rows(caches[group], start, stop)
            xs = (cache, None if ple is None else ple[first : first + stop - start])
            shared = shared_kv[cfg.kv_source[first]] if kind.shared else None
            rope = ropes[FULL if kind.full else SLIDING]
            params = self._params(group, start, stop)
            if first in cfg.kv_source[first + 1 :]:  # keys and values later layers reuse: a run alone
                p = params[0] if isinstance(params, list) else _rows(params, 0, None)
                one_cache, one_ple = _rows(xs, 0, None)
                p = materialize(p)
                x, new, shared_kv[first] = layer_forward(p, x, cfg, kind, rope, ctx, one_cache, None, one_ple)
                new = _rows(new, None, None)
            else:

                def run(p: Params, h: jax.Array, xs: Any, kind: Kind = kind, rope: Rope = rope,
                        shared: KV | None = shared) -> tuple[jax.Array, GroupCache | None]:
                    out, c, _ = layer_forward(p, h, cfg, kind, rope, ctx, xs[0], shared, xs[1])
                    return out, c

                x, new = run_layers(params, x, run, xs)
            if not kind.shared:
                pieces.setdefault(group, []).append(new)
        x = norm(x, self.final_norm.scale[...], cfg.rms_norm_eps)
        if caches is None:
            return x, None
        return x, {group: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) for group, parts in pieces.items()}

    def head(self, x: jax.Array) -> jax.Array:
        logits = super().head(x)
        cap = self.cfg.final_softcap
        return logits if cap is None else jnp.tanh(logits / cap) * cap
