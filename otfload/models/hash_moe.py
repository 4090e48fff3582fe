"""DeepSeek-V4's mixture of experts: routed experts chosen by a learned top-k or, on the first
``num_hash_layers`` layers, by a fixed token-id table, plus one shared expert; SwiGLU clamped at
``swiglu_limit`` everywhere (gate from above, up both ways), as transformers 5.24 computes it.

* Scores: ``sqrt(softplus(logits))`` (``sqrtsoftplus``) or ``sigmoid`` of the router's float32
  logits. Top-k layers choose by ``scores + e_score_correction_bias`` (no groups); hash layers take
  ``tid2eid[token]`` (``[vocab, top_k]`` expert ids). Either way the chosen scores are normalised to
  sum 1 and scaled by ``routed_scaling_factor``.
* Experts run sparsely through :func:`~otfload.models.experts.expert_ffn`, kernels ``[E, out, in]``
  as HF stores each expert (``w1`` gate, ``w3`` up, ``w2`` down).
"""

from __future__ import annotations

from functools import partial
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.deepseek_moe import Experts, FfnDims
from otfload.models.experts import expert_ffn
from otfload.models.layers import ParamOptions, Params, make_param
from otfload.models.mlp import Mlp


class HashMoeShape(Protocol):
    """The config fields the V4 MoE reads."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def num_experts_per_tok(self) -> int: ...
    @property
    def scoring_func(self) -> str: ...
    @property
    def routed_scaling_factor(self) -> float: ...
    @property
    def swiglu_limit(self) -> float: ...


class TokenTable(nnx.Param[jax.Array]):
    """The hash layers' token-id → experts table (int32): a parameter the loader fills and export writes,
    but no gradient can reach it; train with ``wrt=TRAINABLE`` (``nnx.grad``'s default, every
    ``nnx.Param``, would differentiate an integer array)."""


# What gradients are taken with respect to: every parameter but the token tables.
TRAINABLE = nnx.All(nnx.Param, nnx.Not(TokenTable))


class Router(nnx.Module):
    """``kernel [experts, hidden]`` and, hashed, ``tid2eid [vocab, top_k]`` (int32) or, learned, the
    float32 correction ``bias [experts]``."""

    def __init__(
        self, cfg: HashMoeShape, hashed: bool, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        self.kernel = make_param(rngs, (cfg.num_experts, cfg.hidden_size), (None, "embed"), dtype, stack)
        if hashed:
            shape = (cfg.vocab_size, cfg.num_experts_per_tok)
            self.tid2eid = TokenTable(make_param(None, shape, (None, None), jnp.int32, stack).get_value(),
                                      logical_axes=("layers", None, None) if stack else (None, None))
        else:
            self.bias = make_param(rngs, (cfg.num_experts,), (None,), jnp.float32, stack)


class HashMoe(nnx.Module):
    """Router (hashed or learned), routed experts and the shared expert."""

    def __init__(
        self, cfg: HashMoeShape, hashed: bool, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.router = Router(cfg, hashed, **kw)
        self.experts = Experts(cfg, **kw)  # type: ignore[arg-type]  # reads only the expert sizes
        self.shared = Mlp(FfnDims(cfg.hidden_size, cfg.moe_intermediate_size), **kw)


def clamped_swiglu(gate: jax.Array, up: jax.Array, limit: float) -> jax.Array:
    """``silu(min(gate, limit)) * clip(up, -limit, limit)``."""
    return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


def route(router: Params, x: jax.Array, ids: jax.Array, cfg: HashMoeShape) -> tuple[jax.Array, jax.Array]:
    """Each token's experts and weights ``(weights, idx)`` ``[tokens, k]`` (float32, scaled)."""
    logits = jnp.einsum("th,eh->te", x.astype(jnp.float32), router["kernel"].astype(jnp.float32))
    scores = jnp.sqrt(jax.nn.softplus(logits)) if cfg.scoring_func == "sqrtsoftplus" else jax.nn.sigmoid(logits)
    if "tid2eid" in router:
        idx = router["tid2eid"][ids].astype(jnp.int32)
    else:
        _, idx = jax.lax.top_k(scores + router["bias"].astype(jnp.float32), cfg.num_experts_per_tok)
    weights = jnp.take_along_axis(scores, idx, axis=-1)
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, idx


def hash_moe_forward(p: Params, x: jax.Array, ids: jax.Array, cfg: HashMoeShape, impl: str | None = None) -> jax.Array:
    """Routed experts plus the shared expert of ``x [b, s, hidden]`` (``ids [b, s]`` the tokens)."""
    flat = x.reshape(-1, x.shape[-1])
    weights, idx = route(p["router"], flat, ids.reshape(-1), cfg)
    act = partial(clamped_swiglu, limit=cfg.swiglu_limit)
    out = expert_ffn(flat, idx, weights, p["experts"], in_first=False, activation=act, impl=impl).reshape(x.shape)
    s = p["shared"]
    gate, up = (jnp.einsum("bsh,mh->bsm", x, s[n]["kernel"]) for n in ("gate", "up"))
    return out + jnp.einsum("bsm,hm->bsh", act(gate, up), s["down"]["kernel"])
