"""Kimi Delta Attention (KDA, Kimi-Linear): the gated delta rule with one decay per key channel.

A layer projects the normed input to query, key and value heads (``q``/``k``/``v``, ``H`` heads of
``d`` dims each), runs each through its own causal depthwise conv1d of ``K`` taps and SiLU (one
convolution over the three, concatenated, as transformers runs it), and then the recurrence of
:func:`~otfload.models.gated_delta.gated_delta_rule` per head with a decay per key channel::

    S_t = diag(exp(g_t)) S_{t-1} + k_t (beta_t (v_t - (diag(exp(g_t)) S_{t-1})^T k_t))^T,   o_t = S_t^T q_t

with q and k L2-normed (q also by ``d**-0.5``), ``g = -exp(A_log) softplus(f_b(f_a(x)) + dt_bias)``
(``f_a`` a rank-``d`` projection, ``dt_bias`` and the result per channel, ``A_log`` per head) and
``beta = sigmoid(b(x))`` per head. The output is RMSNorm(o) (float32, scale included) times
``sigmoid(g_b(g_a(x)))``, projected back by ``o``.

The recurrence, its chunked prefill and its padding rule (a pad's input zeroed, its decay 1, its
write strength 0) are the Gated DeltaNet's (:mod:`otfload.models.gated_delta`), in float32. The
cache of a layer: ``conv [b, 3 H d, K]`` (the last ``K`` inputs of the q, k and v convolutions, in
the activation dtype) and ``state [b, H, d, d]`` in float32, as transformers keeps them.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.base import GroupCache
from otfload.models.gated_delta import CHUNK, causal_conv1d, l2_normalize, masked_delta_rule
from otfload.models.layers import Dense, Norm, ParamOptions, Params, dense, make_param, rms_norm


class KimiDeltaShape(Protocol):
    """The config fields a KDA layer reads."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def linear_num_heads(self) -> int: ...
    @property
    def linear_head_dim(self) -> int: ...
    @property
    def linear_conv_kernel_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...


def kda_conv_dim(cfg: KimiDeltaShape) -> int:
    """Channels of the three convolutions together (query, key, value): ``3 H d``."""
    return 3 * cfg.linear_num_heads * cfg.linear_head_dim


class KimiDeltaAttention(nnx.Module):
    """``q``/``k``/``v (H d, hidden)``, their convolutions ``q_conv``/``k_conv``/``v_conv (H d, 1, K)`` (as
    HF's depthwise ``conv1d`` stores them), the decay's ``f_a (d, hidden)``, ``f_b (H d, d)``,
    ``dt_bias (H d,)`` (always float32) and ``A_log (1, 1, H, 1)`` (as stored), ``b (H, hidden)``, the output gate's
    ``g_a (d, hidden)`` and ``g_b (H d, d)``, the gated ``norm (d,)`` and ``o (hidden, H d)``."""

    def __init__(
        self, cfg: KimiDeltaShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        h, n, d = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        for name in ("q", "k", "v"):
            setattr(self, name, Dense((n * d, h), ("mlp", "embed"), **kw))
            setattr(self, f"{name}_conv",
                    make_param(rngs, (n * d, 1, cfg.linear_conv_kernel_dim), ("mlp", None, None), dtype, stack))
        self.f_a = Dense((d, h), (None, "embed"), **kw)
        self.f_b = Dense((n * d, d), ("mlp", None), **kw)
        self.dt_bias = make_param(rngs, (n * d,), ("mlp",), jnp.float32, stack)  # float32, as transformers keeps it
        self.A_log = make_param(rngs, (1, 1, n, 1), (None, None, "heads", None), dtype, stack)
        self.b = Dense((n, h), ("heads", "embed"), **kw)
        self.g_a = Dense((d, h), (None, "embed"), **kw)
        self.g_b = Dense((n * d, d), ("mlp", None), **kw)
        self.norm = Norm(d, **kw)
        self.o = Dense((h, n * d), ("embed", "mlp"), **kw)


def _low_rank(p: Params, up: str, down: str, h: jax.Array) -> jax.Array:
    """``up(down(h))`` of a low-rank projection pair: ``[b, s, H d]``."""
    return dense(p[up], dense(p[down], h, "bsh,rh->bsr"), "bsr,cr->bsc")


def kda_forward(
    p: Params, h: jax.Array, cfg: KimiDeltaShape, mask: jax.Array | None, cache: GroupCache | None,
    chunk: int = CHUNK,
) -> tuple[jax.Array, GroupCache | None]:
    """The KDA mixer, called as :func:`~otfload.models.gated_delta.gated_delta_forward` is: ``(output,
    updated cache)`` of the normed input, its pads (``mask`` 0) zeroed first."""
    b, s, _ = h.shape
    n, d = cfg.linear_num_heads, cfg.linear_head_dim
    h = h if mask is None else h * mask[..., None].astype(h.dtype)
    mixed = jnp.concatenate([dense(p[x], h, "bsh,ch->bsc") for x in ("q", "k", "v")], axis=-1)
    weight = jnp.concatenate([p[f"{x}_conv"][:, 0] for x in ("q", "k", "v")])
    mixed, conv_state = causal_conv1d(mixed, weight, None if cache is None else cache["conv"])
    q, k, v = (x.reshape(b, s, n, d) for x in jnp.split(mixed, 3, axis=-1))
    q, k = (l2_normalize(x.astype(jnp.float32)) for x in (q, k))
    forget = _low_rank(p, "f_b", "f_a", h).astype(jnp.float32) + p["dt_bias"].astype(jnp.float32)
    decay_rate = jnp.exp(p["A_log"].astype(jnp.float32).reshape(n, 1))
    g = -decay_rate * jax.nn.softplus(forget.reshape(b, s, n, d))
    beta = jax.nn.sigmoid(dense(p["b"], h, "bsh,nh->bsn").astype(jnp.float32))
    out, state = masked_delta_rule(q * d**-0.5, k, v, g, beta, mask, None if cache is None else cache["state"], chunk)
    gate = _low_rank(p, "g_b", "g_a", h).reshape(b, s, n, d)
    normed = rms_norm(out, p["norm"]["scale"], cfg.rms_norm_eps) * jax.nn.sigmoid(gate.astype(jnp.float32))
    new = None if cache is None else {"conv": conv_state.astype(cache["conv"].dtype), "state": state}
    return dense(p["o"], normed.astype(h.dtype).reshape(b, s, n * d), "bsc,hc->bsh"), new
