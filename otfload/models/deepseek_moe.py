"""DeepSeek's mixture of experts: routed experts with group-limited routing plus always-on shared
experts (DeepSeek-V2/V3/V3.2, GLM-5).

* Routing: softmax scores with greedy or group-limited greedy top-k (``topk_method``, V2), or
  sigmoid scores with a float32 ``e_score_correction_bias`` that steers the choice only, groups
  ranked by the sum of their top-2 and optional ``norm_topk_prob`` (``sigmoid_routing``: V3 and
  later). Both scale the chosen weights by ``routed_scaling_factor``.
* Each token runs through its chosen experts only (:mod:`otfload.models.experts`); the experts'
  SwiGLU kernels keep HF's ``[out, in]`` per-expert orientation, stacked on a leading ``experts``
  axis (``(experts, out, in)``, or ``(layers, experts, out, in)`` scanned) an ``ep`` mesh axis shards.
* The shared experts are one SwiGLU MLP of ``moe_intermediate_size * n_shared_experts``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.experts import Activation, expert_ffn
from otfload.models.layers import ExpertDense, ParamOptions, Params, dense, make_param
from otfload.models.mlp import Mlp, swiglu

GROUP_LIMITED_GREEDY = "group_limited_greedy"


class DeepseekMoeShape(Protocol):
    """The config fields :class:`DeepseekMoe` and :func:`deepseek_moe_forward` read."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def num_experts_per_tok(self) -> int: ...
    @property
    def n_shared_experts(self) -> int: ...
    @property
    def n_group(self) -> int: ...
    @property
    def topk_group(self) -> int: ...
    @property
    def topk_method(self) -> str: ...
    @property
    def norm_topk_prob(self) -> bool: ...
    @property
    def routed_scaling_factor(self) -> float: ...
    @property
    def sigmoid_routing(self) -> bool: ...


@dataclass(frozen=True)
class FfnDims:
    """The sizes of a bias-free SwiGLU MLP (:class:`~otfload.models.mlp.Mlp`'s config)."""

    hidden_size: int
    intermediate_size: int
    mlp_bias: bool = False


class Experts(nnx.Module):
    """Routed experts' SwiGLU kernels (``[out, in]`` each) stacked on a leading ``experts`` axis."""

    def __init__(
        self, cfg: DeepseekMoeShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        e, h, m = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.gate = ExpertDense(e, (m, h), ("mlp", "embed"), bias=False, **kw)
        self.up = ExpertDense(e, (m, h), ("mlp", "embed"), bias=False, **kw)
        self.down = ExpertDense(e, (h, m), ("embed", "mlp"), bias=False, **kw)


class Router(nnx.Module):
    """Router kernel ``[experts, hidden]``; sigmoid routing adds the (always float32) correction bias."""

    def __init__(
        self, cfg: DeepseekMoeShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        self.kernel = make_param(rngs, (cfg.num_experts, cfg.hidden_size), (None, "embed"), dtype, stack)
        if cfg.sigmoid_routing:
            self.bias = make_param(rngs, (cfg.num_experts,), (None,), jnp.float32, stack)


class DeepseekMoe(nnx.Module):
    """Router, routed experts and (when ``n_shared_experts``) the shared experts' MLP."""

    def __init__(
        self, cfg: DeepseekMoeShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.router = Router(cfg, **kw)
        self.experts = Experts(cfg, **kw)
        if cfg.n_shared_experts:
            self.shared = Mlp(FfnDims(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts), **kw)


def _keep_top_groups(choice: jax.Array, group_scores: jax.Array, cfg: DeepseekMoeShape, fill: float) -> jax.Array:
    """``choice [t, E]`` with every expert outside the ``topk_group`` best groups set to ``fill``."""
    _, top_groups = jax.lax.top_k(group_scores, cfg.topk_group)
    kept = jax.nn.one_hot(top_groups, cfg.n_group, dtype=jnp.bool_).any(axis=-2)
    kept = jnp.repeat(kept, cfg.num_experts // cfg.n_group, axis=-1)
    return jnp.where(kept, choice, fill)


def group_route(router: Params, x: jax.Array, cfg: DeepseekMoeShape) -> tuple[jax.Array, jax.Array]:
    """Each token's top-k experts ``(weights, idx)`` (``[tokens, k]``, float32, routed scaling applied)."""
    logits = jnp.einsum("th,eh->te", x.astype(jnp.float32), router["kernel"].astype(jnp.float32))
    tokens, experts = logits.shape
    if cfg.sigmoid_routing:
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
        if cfg.topk_method == GROUP_LIMITED_GREEDY:
            group_max = scores.reshape(tokens, cfg.n_group, experts // cfg.n_group).max(-1)
            scores = _keep_top_groups(scores, group_max, cfg, 0.0)
        weights, idx = jax.lax.top_k(scores, cfg.num_experts_per_tok)
    return weights * cfg.routed_scaling_factor, idx


def silu_gated(gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU's activation of the experts' gate and up projections."""
    return jax.nn.silu(gate) * up


def deepseek_moe_forward(
    p: Params, x: jax.Array, cfg: DeepseekMoeShape, impl: str | None = None, activation: Activation = silu_gated,
    shared: Callable[[Params, jax.Array], jax.Array] = swiglu,
) -> jax.Array:
    """Routed experts (each token through its top-k only, :func:`~otfload.models.experts.expert_ffn`)
    plus the shared experts, of ``x [b, s, hidden]``; ``activation`` and ``shared`` are the experts'
    activation and the shared MLP (Nemotron-H: squared ReLU experts without a gate, an ungated MLP).
    With ``latent_in`` / ``latent_out`` projections (Nemotron-H's latent MoE) the routed experts run in
    the latent space between them; routing and the shared experts see ``x``."""
    flat = x.reshape(-1, x.shape[-1])
    weights, idx = group_route(p["router"], flat, cfg)
    inner = dense(p["latent_in"], flat, "th,lh->tl") if "latent_in" in p else flat
    out = expert_ffn(inner, idx, weights, p["experts"], in_first=False, activation=activation, impl=impl)
    out = (dense(p["latent_out"], out, "tl,hl->th") if "latent_out" in p else out).reshape(x.shape)
    return out + shared(p["shared"], x) if "shared" in p else out
