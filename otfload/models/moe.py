"""The sparse mixture-of-experts block Mixtral introduced (Qwen3-MoE and GPT-OSS use it too): a
router ``[E, hidden]`` (optional bias), its top-k rule, and the experts' gated feed-forward.

Expert weights of a layer are stacked on a leading ``experts`` axis (logical axis ``"experts"``,
sharded on ``ep`` by the default rules) in the orientation the checkpoint stores them, so loading
never transposes: ``gate``/``up`` kernels ``[E, inter, hidden]`` and ``down`` ``[E, hidden, inter]``
(per-expert HF ``[out, in]`` weights: Mixtral, Qwen3-MoE), or ``[E, hidden, inter]`` and
``[E, inter, hidden]`` with ``experts_in_first`` (GPT-OSS's fused ``[E, in, out]`` tensors).

Only each token's top-k experts run on it: tokens are grouped by expert for grouped matmuls
(:mod:`otfload.models.experts`; exact, no capacity limit), with the experts split over an ``ep``
mesh axis when there is one.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.experts import expert_ffn
from otfload.models.gqa import Attention, GqaShape
from otfload.models.layers import Dense, ExpertDense, Norm, ParamOptions, Params, dense, make_param

# Routing rules: softmax over all experts then the top k (renormalised if ``norm_topk_prob``), or
# the top k logits then a softmax over them. Expert activations: SwiGLU, or GPT-OSS's clamped one.
SOFTMAX_TOPK, TOPK_SOFTMAX = "softmax_topk", "topk_softmax"
SWIGLU, CLAMPED_SWIGLU = "swiglu", "clamped_swiglu"


class MoeShape(GqaShape, Protocol):
    """The config fields :class:`SparseMoe`, :class:`MoeDecoderLayer` and :func:`moe_forward` read."""

    @property
    def num_experts(self) -> int: ...
    @property
    def num_experts_per_tok(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...
    @property
    def routing(self) -> str: ...
    @property
    def norm_topk_prob(self) -> bool: ...
    @property
    def router_bias(self) -> bool: ...
    @property
    def expert_bias(self) -> bool: ...
    @property
    def activation(self) -> str: ...
    @property
    def swiglu_alpha(self) -> float: ...
    @property
    def swiglu_limit(self) -> float: ...
    @property
    def attention_sinks(self) -> bool: ...
    @property
    def experts_in_first(self) -> bool: ...


class SparseMoe(nnx.Module):
    """Router ``[E, hidden]`` and the experts' ``gate``/``up``/``down`` weights."""

    def __init__(self, cfg: MoeShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
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

    def __init__(self, cfg: MoeShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        self.input_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs, stack=stack)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, stack=stack)
        if cfg.attention_sinks:
            self.attn.sinks = make_param(rngs, (cfg.num_attention_heads,), ("heads",), dtype, stack)
        self.post_attn_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs, stack=stack)
        self.moe = SparseMoe(cfg, dtype=dtype, rngs=rngs, stack=stack)


def route(logits: jax.Array, cfg: MoeShape) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts: ``(weights, idx)``, both ``[..., k]``, weights in float32."""
    logits = logits.astype(jnp.float32)
    if cfg.routing == TOPK_SOFTMAX:
        top, idx = jax.lax.top_k(logits, cfg.num_experts_per_tok)
        return jax.nn.softmax(top, axis=-1), idx
    top, idx = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.num_experts_per_tok)
    if cfg.norm_topk_prob:
        top = top / top.sum(axis=-1, keepdims=True)
    return top, idx


def expert_activation(gate: jax.Array, up: jax.Array, cfg: MoeShape) -> jax.Array:
    """The experts' gated activation (``cfg.activation``) of their gate and up projections."""
    if cfg.activation == CLAMPED_SWIGLU:
        gate = jnp.minimum(gate, cfg.swiglu_limit)
        up = jnp.clip(up, -cfg.swiglu_limit, cfg.swiglu_limit)
        return (up + 1) * gate * jax.nn.sigmoid(gate * cfg.swiglu_alpha)
    return jax.nn.silu(gate) * up


def moe_forward(p: Params, h: jax.Array, cfg: MoeShape, impl: str | None = None) -> jax.Array:
    """The MoE feed-forward of ``h [batch, seq, hidden]`` from a :class:`SparseMoe` param dict:
    each token through its top-k experts only (:func:`~otfload.models.experts.expert_ffn`)."""
    flat = h.reshape(-1, h.shape[-1])
    weights, idx = route(dense(p["router"], flat, "th,eh->te"), cfg)
    experts = {name: p[name] for name in ("gate", "up", "down")}
    out = expert_ffn(flat, idx, weights, experts, in_first=cfg.experts_in_first,
                     activation=lambda g, u: expert_activation(g, u, cfg), impl=impl)
    return out.reshape(h.shape)
