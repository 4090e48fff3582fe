"""Reference Flax NNX decoder for DeepSeek-V2 and DeepSeek-V3, mirroring transformers 5.23.

* Multi-head latent attention (MLA): queries from ``q`` (or the low-rank ``q_a`` → norm → ``q_b``);
  keys and values from a compressed latent (``kv_a`` → norm → ``k_b``/``v_b`` per head) plus one
  shared RoPE key (``k_rope``). The RoPE part uses DeepSeek's interleaved pair layout (V2 always,
  V3 when ``rope_interleave``); YaRN scaling and its softmax ``mscale`` are supported. Attention
  runs in the absorbed form (``k_b`` folded into the queries, ``v_b`` applied after attending), so
  the KV cache holds the latent and the rotated key per token.
* The first ``first_k_dense_replace`` layers have a dense MLP, the rest a routed MoE with shared
  experts. The two kinds of layer are two homogeneous groups (``dense_layers``, ``moe_layers``),
  each scanned separately with ``scan_layers``.
* Routing: V2 softmax scores with greedy or group-limited greedy top-k; V3 sigmoid scores with
  ``e_score_correction_bias``, group selection by the sum of each group's top-2 and optional
  ``norm_topk_prob``. Both scale the chosen weights by ``routed_scaling_factor``. Each token runs
  through its chosen experts only (:mod:`otfload.models.experts`).

Kernels keep HF's ``[out, in]`` orientation (output dims first, e.g. ``q`` is ``(heads, head_dim,
hidden)``), so loading needs only slices and reshapes. Experts are stacked on an ``experts`` axis
(``(experts, out, in)``, or ``(layers, experts, out, in)`` scanned) so an ``ep`` mesh axis can shard them.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.deepseek.config import DeepseekConfig
from otfload.models.attention import Context, attention, write_cache
from otfload.models.base import CacheLayout, CausalLM, GroupCache, GroupCaches, group_cache
from otfload.models.experts import expert_ffn
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
    rms_norm,
    rope_attention_factor,
    rope_inv_freq,
    rope_tables,
    run_layers,
    yarn_mscale,
)

# transformers builds q_a_layernorm and kv_a_layernorm without passing rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# What every layer's attention shares: RoPE ``(cos, sin)`` of the call's positions and the softmax scale.
MlaRope = tuple[jax.Array, jax.Array, float]


# --- RoPE ----------------------------------------------------------------------------------------


def _rope_kind(cfg: DeepseekConfig) -> str:
    scaling = cfg.rope_scaling or {}
    return scaling.get("rope_type", scaling.get("type", "default")) or "default"


def softmax_scale(cfg: DeepseekConfig) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for scaled RoPE."""
    scale: float = cfg.qk_head_dim**-0.5
    mscale_all_dim = (cfg.rope_scaling or {}).get("mscale_all_dim")
    factor = (cfg.rope_scaling or {}).get("factor", 1.0)
    if _rope_kind(cfg) != "default" and mscale_all_dim and factor > 1:
        scale *= yarn_mscale(factor, mscale_all_dim) ** 2
    return scale


def apply_pair_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """RoPE on ``x [b, s, h, d]``. Interleaved pairs ``(x0, x1), (x2, x3), ...`` are de-interleaved
    first, as transformers' V3 does; the result is the rotate-half rotation of ``[x_even, x_odd]``.
    V2's complex-number rotation keeps the pairs interleaved instead: a permutation of the same
    values, applied alike to queries and keys, so attention scores are identical."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, cos, sin)


# --- parameters ----------------------------------------------------------------------------------


class MLAttention(nnx.Module):
    """Multi-head latent attention parameters; ``kv_a_proj_with_mqa`` and ``kv_b_proj`` are split
    into per-role leaves (``kv_a``/``k_rope`` and ``k_b``/``v_b``) by the mapping's hooks."""

    def __init__(
        self, cfg: DeepseekConfig, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        h, n = cfg.hidden_size, cfg.num_attention_heads
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        if cfg.q_lora_rank is None:
            self.q = Dense((n, cfg.qk_head_dim, h), ("heads", "head_dim", "embed"), **kw)
        else:
            self.q_a = Dense((cfg.q_lora_rank, h), ("q_lora", "embed"), **kw)
            self.q_a_norm = Norm(cfg.q_lora_rank, **kw)
            self.q_b = Dense((n, cfg.qk_head_dim, cfg.q_lora_rank), ("heads", "head_dim", "q_lora"), **kw)
        self.kv_a = Dense((cfg.kv_lora_rank, h), ("kv_lora", "embed"), **kw)
        self.k_rope = Dense((cfg.qk_rope_head_dim, h), ("head_dim", "embed"), **kw)
        self.kv_a_norm = Norm(cfg.kv_lora_rank, **kw)
        self.k_b = Dense((n, cfg.qk_nope_head_dim, cfg.kv_lora_rank), ("heads", "head_dim", "kv_lora"), **kw)
        self.v_b = Dense((n, cfg.v_head_dim, cfg.kv_lora_rank), ("heads", "head_dim", "kv_lora"), **kw)
        self.o = Dense((h, n, cfg.v_head_dim), ("embed", "heads", "head_dim"), **kw)


class Mlp(nnx.Module):
    """SwiGLU MLP (the dense layers' MLP and the shared experts)."""

    def __init__(
        self, hidden: int, inner: int, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.gate = Dense((inner, hidden), ("mlp", "embed"), **kw)
        self.up = Dense((inner, hidden), ("mlp", "embed"), **kw)
        self.down = Dense((hidden, inner), ("embed", "mlp"), **kw)


class Experts(nnx.Module):
    """Routed experts' SwiGLU kernels (``[out, in]`` each) stacked on a leading ``experts`` axis."""

    def __init__(
        self, cfg: DeepseekConfig, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        e, h, m = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.gate = ExpertDense(e, (m, h), ("mlp", "embed"), bias=False, **kw)
        self.up = ExpertDense(e, (m, h), ("mlp", "embed"), bias=False, **kw)
        self.down = ExpertDense(e, (h, m), ("embed", "mlp"), bias=False, **kw)


class Router(nnx.Module):
    """Router kernel ``[experts, hidden]``; V3 adds the (always float32) ``e_score_correction_bias``."""

    def __init__(
        self, cfg: DeepseekConfig, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        self.kernel = make_param(rngs, (cfg.num_experts, cfg.hidden_size), (None, "embed"), dtype, stack)
        if cfg.model_type == "deepseek_v3":
            self.bias = make_param(rngs, (cfg.num_experts,), (None,), jnp.float32, stack)


class Moe(nnx.Module):
    def __init__(
        self, cfg: DeepseekConfig, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.router = Router(cfg, **kw)
        self.experts = Experts(cfg, **kw)
        if cfg.n_shared_experts:
            self.shared = Mlp(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts, **kw)


class DecoderLayer(nnx.Module):
    """One layer (``stack=L``: L layers on a leading axis); ``moe`` picks routed MoE over dense MLP."""

    def __init__(
        self, cfg: DeepseekConfig, *, moe: bool, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.input_norm = Norm(cfg.hidden_size, **kw)
        self.attn = MLAttention(cfg, **kw)
        self.post_attn_norm = Norm(cfg.hidden_size, **kw)
        if moe:
            self.moe = Moe(cfg, **kw)
        else:
            self.mlp = Mlp(cfg.hidden_size, cfg.intermediate_size, **kw)


# --- layer math ----------------------------------------------------------------------------------


def mla_forward(
    a: Params, x: jax.Array, cfg: DeepseekConfig, rope: MlaRope, ctx: Context, cache: GroupCache | None
) -> tuple[jax.Array, GroupCache | None]:
    """Multi-head latent attention in its absorbed form: ``k_b`` is folded into the queries and
    ``v_b`` applied after attending, so keys and values are the compressed latent itself (one shared
    "head" of ``kv_lora_rank + qk_rope_head_dim`` dims, the latent doubling as the value) and the
    cache holds ``[latent, rotated key]`` per token instead of per-head keys and values."""
    cos, sin, scale = rope
    if cfg.q_lora_rank is None:
        q = dense(a["q"], x, "bsh,ndh->bsnd")
    else:
        q_latent = rms_norm(dense(a["q_a"], x, "bsh,rh->bsr"), a["q_a_norm"]["scale"], LATENT_NORM_EPS)
        q = dense(a["q_b"], q_latent, "bsr,ndr->bsnd")
    q_nope, q_rot = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
    latent = rms_norm(dense(a["kv_a"], x, "bsh,rh->bsr"), a["kv_a_norm"]["scale"], LATENT_NORM_EPS)
    k_rot = apply_pair_rope(dense(a["k_rope"], x, "bsh,dh->bsd")[:, :, None, :], cos, sin, cfg.rope_interleave)
    q_rot = apply_pair_rope(q_rot, cos, sin, cfg.rope_interleave)
    q = jnp.concatenate([jnp.einsum("bsnd,ndr->bsnr", q_nope, a["k_b"]["kernel"]), q_rot], axis=-1)
    k = jnp.concatenate([latent[:, :, None, :], k_rot.astype(latent.dtype)], axis=-1)
    if cache is not None:
        cache = {"k": write_cache(cache, "k", k, ctx)}
        k = cache["k"]
    out = attention(q, k, k[..., : cfg.kv_lora_rank], ctx, scale=scale)
    out = jnp.einsum("bsnr,ndr->bsnd", out, a["v_b"]["kernel"])
    return dense(a["o"], out, "bsnd,hnd->bsh"), cache


def mlp_forward(m: Params, x: jax.Array) -> jax.Array:
    act = jax.nn.silu(dense(m["gate"], x, "...h,mh->...m")) * dense(m["up"], x, "...h,mh->...m")
    return dense(m["down"], act, "...m,hm->...h")


def _keep_top_groups(choice: jax.Array, group_scores: jax.Array, cfg: DeepseekConfig, fill: float) -> jax.Array:
    """``choice [t, E]`` with every expert outside the ``topk_group`` best groups set to ``fill``."""
    _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
    kept = jax.nn.one_hot(top_groups, cfg.n_group, dtype=jnp.bool_).any(axis=-2)
    kept = jnp.repeat(kept, cfg.num_experts // cfg.n_group, axis=-1)
    return jnp.where(kept, choice, fill)


def route(router: Params, x: jax.Array, cfg: DeepseekConfig) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts ``(weights, idx)`` (``[tokens, k]``, float32, routed scaling applied)."""
    logits = jnp.einsum("th,eh->te", x.astype(jnp.float32), router["kernel"].astype(jnp.float32))
    tokens, experts = logits.shape
    if cfg.model_type == "deepseek_v3":
        scores = jax.nn.sigmoid(logits)
        choice = scores + router["bias"].astype(jnp.float32)
        grouped = choice.reshape(tokens, cfg.n_group, experts // cfg.n_group)
        choice = _keep_top_groups(choice, jax.lax.top_k(grouped, 2)[0].sum(-1), cfg, -jnp.inf)
        _, idx = jax.lax.top_k(choice, cfg.num_experts_per_tok)
        weights = jnp.take_along_axis(scores, idx, axis=-1)
        if cfg.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
        if cfg.topk_method == "group_limited_greedy":
            group_max = scores.reshape(tokens, cfg.n_group, experts // cfg.n_group).max(-1)
            scores = _keep_top_groups(scores, group_max, cfg, 0.0)
        weights, idx = jax.lax.top_k(scores, cfg.num_experts_per_tok)
    return weights * cfg.routed_scaling_factor, idx


def moe_forward(p: Params, x: jax.Array, cfg: DeepseekConfig, impl: str | None = None) -> jax.Array:
    """Routed experts (each token through its top-k only, :func:`~otfload.models.experts.expert_ffn`)
    plus the shared experts."""
    flat = x.reshape(-1, x.shape[-1])
    weights, idx = route(p["router"], flat, cfg)
    out = expert_ffn(flat, idx, weights, p["experts"], in_first=False,
                     activation=lambda g, u: jax.nn.silu(g) * u, impl=impl).reshape(x.shape)
    return out + mlp_forward(p["shared"], x) if "shared" in p else out


def layer_forward(
    p: Params, x: jax.Array, cfg: DeepseekConfig, rope: MlaRope, ctx: Context, cache: GroupCache | None
) -> tuple[jax.Array, GroupCache | None]:
    """One decoder layer (dense or MoE, by which parameters ``p`` holds): ``(x, updated cache)``."""
    out, cache = mla_forward(p["attn"], rms_norm(x, p["input_norm"]["scale"], cfg.rms_norm_eps), cfg, rope, ctx, cache)
    x = x + out
    h = rms_norm(x, p["post_attn_norm"]["scale"], cfg.rms_norm_eps)
    return x + (moe_forward(p["moe"], h, cfg, ctx.moe_impl) if "moe" in p else mlp_forward(p["mlp"], h)), cache


# --- model ---------------------------------------------------------------------------------------


def _layer_group(
    cfg: DeepseekConfig, count: int, moe: bool, scan: bool, dtype: DTypeLike, rngs: nnx.Rngs | None
) -> nnx.Module | None:
    if count == 0:
        return None
    if scan:
        return DecoderLayer(cfg, moe=moe, dtype=dtype, rngs=rngs, stack=count)
    return nnx.List([DecoderLayer(cfg, moe=moe, dtype=dtype, rngs=rngs) for _ in range(count)])


class DeepseekForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for DeepSeek-V2/V3.

    ``dense_layers`` holds HF layers ``0 .. first_k_dense_replace - 1`` and ``moe_layers`` the rest;
    with ``scan_layers`` each group is stacked on a leading ``layers`` axis and run by its own scan.
    """

    cfg: DeepseekConfig

    def __init__(
        self, cfg: DeepseekConfig, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.dense_layers = _layer_group(cfg, cfg.first_k_dense_replace, False, scan_layers, dtype, rngs)
        self.moe_layers = _layer_group(cfg, cfg.num_moe_layers, True, scan_layers, dtype, rngs)
        self.final_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype=dtype, rngs=rngs)

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        latent = (1, cfg.kv_lora_rank + cfg.qk_rope_head_dim, 0)  # one shared latent "head"; values read from it
        counts = {"dense_layers": cfg.first_k_dense_replace, "moe_layers": cfg.num_moe_layers}
        return {group: (n, *latent) for group, n in counts.items() if n}

    def _run_group(
        self, name: str, x: jax.Array, rope: MlaRope, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCache | None]:
        group = self.dense_layers if name == "dense_layers" else self.moe_layers
        if group is None:
            return x, None
        params = [pure(layer) for layer in group] if isinstance(group, nnx.List) else pure(group)
        return run_layers(params, x, lambda p, h, c: layer_forward(p, h, self.cfg, rope, ctx, c),
                          group_cache(caches, name))

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
        cos, sin = rope_tables(ctx.positions, inv_freq, rope_attention_factor(cfg.rope_scaling))
        rope = (cos, sin, softmax_scale(cfg))
        new: dict[str, GroupCache | None] = {}
        for name in ("dense_layers", "moe_layers"):
            x, new[name] = self._run_group(name, x, rope, ctx, caches)
        x = rms_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps)
        return x, None if caches is None else {k: v for k, v in new.items() if v is not None}
