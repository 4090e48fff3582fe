"""Flax NNX decoder for Llama 4's text model, assembled from :mod:`otfload.models`' blocks.

Pre-norm layers with GQA attention (:class:`~otfload.models.gqa.Attention`, no learned q/k norm):
RoPE layers rotate interleaved pairs (transformers' complex-number RoPE, de-interleaved alike for q
and k: :func:`~otfload.models.mla.apply_pair_rope`) then RMS-normalise q and k without a weight
(``use_qk_norm``) and may be chunked (each query sees the keys of its own ``attention_chunk_size``
chunk only); NoPE layers scale the queries by ``1 + attn_scale * log1p(floor((slot + 1) /
floor_scale))`` (``attn_temperature_tuning``). The attention kind is a per-layer flag carried
through the scan, so a group mixes both.

Feed-forward: ``dense_layers`` have a SwiGLU MLP of ``intermediate_size_mlp``; ``moe_layers`` a
shared expert (SwiGLU of ``intermediate_size``) plus routed experts: the top-k router logits
through a sigmoid scale each token's *input* to its experts (not their outputs), whose fused
kernels keep HF's ``[E, in, out]`` layout. Each group is stacked and scanned on its own with
``scan_layers``; runs of consecutive layers of one group run in HF layer order.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.llama4.config import Llama4Config
from otfload.models.attention import Context, self_attention
from otfload.models.base import CacheLayout, CausalLM, GroupCache, GroupCaches
from otfload.models.deepseek_moe import FfnDims
from otfload.models.experts import expert_ffn
from otfload.models.gqa import Attention, Rope, gqa_rope
from otfload.models.layers import (
    Dense,
    Embed,
    ExpertDense,
    Norm,
    ParamOptions,
    Params,
    dense,
    pure,
    rms_norm,
    run_layers,
)
from otfload.models.mla import apply_pair_rope
from otfload.models.mlp import Mlp, swiglu

GROUPS = ("dense_layers", "moe_layers")


class Llama4Moe(nnx.Module):
    """Router ``[E, hidden]``, routed experts ``gate``/``up [E, hidden, inter]`` and ``down [E, inter,
    hidden]`` (in x out), and the ``shared`` expert."""

    def __init__(self, cfg: Llama4Config, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        e, h, m = cfg.num_experts, cfg.hidden_size, cfg.intermediate_size
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.router = Dense((e, h), (None, "embed"), **kw)
        self.gate = ExpertDense(e, (m, h), ("mlp", "embed"), bias=False, in_first=True, **kw)
        self.up = ExpertDense(e, (m, h), ("mlp", "embed"), bias=False, in_first=True, **kw)
        self.down = ExpertDense(e, (h, m), ("embed", "mlp"), bias=False, in_first=True, **kw)
        self.shared = Mlp(FfnDims(h, m), **kw)


class Llama4Layer(nnx.Module):
    """One layer's parameters: norms, attention and a dense MLP (``mlp``) or experts (``moe``)."""

    def __init__(self, cfg: Llama4Config, moe: bool, *, dtype: DTypeLike, rngs: nnx.Rngs | None,
                 stack: int | None = None) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.input_norm = Norm(cfg.hidden_size, **kw)
        self.attn = Attention(cfg, **kw)
        self.post_attn_norm = Norm(cfg.hidden_size, **kw)
        if moe:
            self.moe = Llama4Moe(cfg, **kw)
        else:
            self.mlp = Mlp(FfnDims(cfg.hidden_size, cfg.intermediate_size_mlp), **kw)


def moe_forward(p: Params, h: jax.Array, cfg: Llama4Config, impl: str | None) -> jax.Array:
    """Shared expert plus routed experts of ``h [b, s, hidden]``: each token's top-k experts run on
    the token scaled by ``sigmoid(logit)`` (as ``k`` rows of one expert each, weight 1)."""
    flat = h.reshape(-1, h.shape[-1])
    logits = dense(p["router"], flat, "th,eh->te")
    top, idx = jax.lax.top_k(logits, cfg.num_experts_per_tok)
    scores = jax.nn.sigmoid(top.astype(jnp.float32)).astype(flat.dtype)
    k = cfg.num_experts_per_tok
    rows = (flat[:, None, :] * scores[..., None]).reshape(-1, flat.shape[-1])
    experts = {name: p[name] for name in ("gate", "up", "down")}
    out = expert_ffn(rows, idx.reshape(-1, 1), jnp.ones((rows.shape[0], 1), jnp.float32), experts, in_first=True,
                     activation=lambda g, u: jax.nn.silu(g) * u, impl=impl)
    routed = out.reshape(flat.shape[0], k, -1).sum(axis=1)
    return swiglu(p["shared"], h) + routed.reshape(h.shape)


def _unit_norm(x: jax.Array, eps: float) -> jax.Array:
    """transformers' ``Llama4TextL2Norm``: an RMS norm over ``head_dim`` without a weight."""
    return rms_norm(x, jnp.ones((), x.dtype), eps)


def attention_forward(
    a: Params, h: jax.Array, cfg: Llama4Config, rope: Rope, flags: jax.Array, ctx: Context, cache: GroupCache | None
) -> tuple[jax.Array, GroupCache | None]:
    """Self-attention of the normed ``h`` for a layer whose ``flags`` are ``[use_rope, chunked]``."""
    q = dense(a["q"], h, "bsh,ndh->bsnd")
    k = dense(a["k"], h, "bsh,ndh->bsnd")
    v = dense(a["v"], h, "bsh,ndh->bsnd")
    use_rope = flags[0]
    qr, kr = apply_pair_rope(q, *rope, interleaved=True), apply_pair_rope(k, *rope, interleaved=True)
    if cfg.use_qk_norm:
        qr, kr = _unit_norm(qr, cfg.rms_norm_eps), _unit_norm(kr, cfg.rms_norm_eps)
    if cfg.attn_temperature_tuning:
        slots = ctx.q_index.astype(jnp.float32)
        temp = jnp.log1p(jnp.floor((slots + 1.0) / cfg.floor_scale)) * cfg.attn_scale + 1.0
        q = (q * temp[None, :, None, None]).astype(q.dtype)
    q, k = jnp.where(use_rope, qr, q), jnp.where(use_rope, kr, k)
    chunk = None if cfg.attention_chunk_size is None else jnp.where(flags[1], cfg.attention_chunk_size, 0)
    out, cache = self_attention(q, k, v, ctx, cache, scale=cfg.head_dim**-0.5, chunk=chunk)
    return dense(a["o"], out, "bsnd,hnd->bsh"), cache


def layer_forward(
    p: Params, x: jax.Array, cfg: Llama4Config, rope: Rope, flags: jax.Array, ctx: Context, cache: GroupCache | None
) -> tuple[jax.Array, GroupCache | None]:
    """One layer as a pure function of its parameter dict: ``(x, updated cache)``."""
    h = rms_norm(x, p["input_norm"]["scale"], cfg.rms_norm_eps)
    out, cache = attention_forward(p["attn"], h, cfg, rope, flags, ctx, cache)
    x = x + out
    h = rms_norm(x, p["post_attn_norm"]["scale"], cfg.rms_norm_eps)
    ffn = moe_forward(p["moe"], h, cfg, ctx.moe_impl) if "moe" in p else swiglu(p["mlp"], h)
    return x + ffn, cache


def layer_runs(cfg: Llama4Config) -> Iterator[tuple[str, int, int]]:
    """``(group, start, stop)``: maximal runs of consecutive HF layers of one group, in HF order
    (``start``/``stop`` index the group's stack)."""
    group_of = {i: g for g in GROUPS for i in getattr(cfg, g)}
    counts = dict.fromkeys(GROUPS, 0)
    layer = 0
    while layer < cfg.num_hidden_layers:
        group, start = group_of[layer], counts[group_of[layer]]
        while layer < cfg.num_hidden_layers and group_of[layer] == group:
            layer, counts[group] = layer + 1, counts[group] + 1
        yield group, start, counts[group]


def _rows(tree: Any, start: int, stop: int) -> Any:
    return jax.tree.map(lambda a: a[start:stop], tree)


class Llama4ForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for Llama 4's text model."""

    cfg: Llama4Config

    def __init__(
        self, cfg: Llama4Config, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        for group in GROUPS:
            n, moe = len(getattr(cfg, group)), group == "moe_layers"
            if n and scan_layers:
                setattr(self, group, Llama4Layer(cfg, moe, dtype=dtype, rngs=rngs, stack=n))
            else:
                setattr(self, group, nnx.List([Llama4Layer(cfg, moe, dtype=dtype, rngs=rngs) for _ in range(n)])
                        if n else None)
        self.init_output(cfg.vocab_size, cfg.hidden_size, dtype, rngs)

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        shape = (cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
        return {g: (len(getattr(cfg, g)), *shape) for g in GROUPS if getattr(cfg, g)}

    def _params(self, group: str, start: int, stop: int) -> Params | list[Params]:
        layers = getattr(self, group)
        if isinstance(layers, nnx.List):
            return [pure(layers[i]) for i in range(start, stop)]
        sliced: Params = _rows(pure(layers), start, stop)
        return sliced

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        rope = gqa_rope(ctx.positions, cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        flags = {g: np.array([[cfg.use_rope[i], cfg.chunked[i]] for i in getattr(cfg, g)], bool).reshape(-1, 2)
                 for g in GROUPS}

        def run(p: Params, h: jax.Array, xs: Any) -> tuple[jax.Array, GroupCache | None]:
            return layer_forward(p, h, cfg, rope, xs[1], ctx, xs[0])

        x = self.embed_tokens(input_ids)
        pieces: dict[str, list[GroupCache]] = {}
        for group, start, stop in layer_runs(cfg):
            cache = None if caches is None else _rows(caches[group], start, stop)
            x, new = run_layers(self._params(group, start, stop), x, run, (cache, flags[group][start:stop]))
            if new is not None:
                pieces.setdefault(group, []).append(new)
        x = rms_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps)
        if caches is None:
            return x, None
        return x, {g: jax.tree.map(lambda *a: jnp.concatenate(a), *parts) for g, parts in pieces.items()}
