"""Manifold-constrained hyper-connections (mHC, DeepSeek-V4): the residual is ``hc_mult`` streams
``[b, s, hc, hidden]``; each block reads one mix of them and writes its output back into each.

From the streams (flattened, RMS-normalised without a weight) one projection ``fn`` gives three
weights: ``pre`` (``sigmoid + eps``: how the streams collapse into the block's input), ``post``
(``2 sigmoid``: how the block's output spreads over the streams) and ``comb`` (a softmax made
doubly stochastic by ``hc_sinkhorn_iters`` Sinkhorn-Knopp rounds: how the streams carry over), each
scaled by its entry of ``scale`` and shifted by ``base``. After the last layer a head (``hc_fn``,
``hc_base``, ``hc_scale``) collapses the streams with its own ``pre`` weights. Float32 throughout,
as transformers keeps these modules.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.layers import Params, make_param


class HcShape(Protocol):
    """The config fields the hyper-connections read."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def hc_mult(self) -> int: ...
    @property
    def hc_sinkhorn_iters(self) -> int: ...
    @property
    def hc_eps(self) -> float: ...
    @property
    def rms_norm_eps(self) -> float: ...


class HyperConnection(nnx.Module):
    """One block's mixing weights: ``fn [(2 + hc) hc, hc hidden]``, ``base [(2 + hc) hc]``, ``scale [3]``
    (float32 whatever the model's dtype, as transformers keeps them)."""

    def __init__(self, cfg: HcShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        n = cfg.hc_mult
        self.fn = make_param(rngs, ((2 + n) * n, n * cfg.hidden_size), (None, "embed"), jnp.float32, stack)
        self.base = make_param(rngs, ((2 + n) * n,), (None,), jnp.float32, stack)
        self.scale = make_param(rngs, (3,), (None,), jnp.float32, stack)


class HyperHead(nnx.Module):
    """The final collapse: ``hc_fn [hc, hc hidden]``, ``hc_base [hc]``, ``hc_scale [1]`` (float32)."""

    def __init__(self, cfg: HcShape, *, rngs: nnx.Rngs | None) -> None:
        n = cfg.hc_mult
        self.fn = make_param(rngs, (n, n * cfg.hidden_size), (None, "embed"), jnp.float32)
        self.base = make_param(rngs, (n,), (None,), jnp.float32)
        self.scale = make_param(rngs, (1,), (None,), jnp.float32)


def _mixes(streams: jax.Array, fn: jax.Array, eps: float) -> jax.Array:
    """``fn`` applied to the streams flattened and RMS-normalised (no weight): ``[b, s, fn rows]``."""
    b, s = streams.shape[:2]
    flat = streams.reshape(b, s, -1).astype(jnp.float32)
    flat = flat * jax.lax.rsqrt(jnp.mean(flat * flat, axis=-1, keepdims=True) + eps)
    return jnp.einsum("bsi,oi->bso", flat, fn.astype(jnp.float32))


def _collapse(pre: jax.Array, streams: jax.Array) -> jax.Array:
    return jnp.einsum("bsn,bsnd->bsd", pre, streams.astype(jnp.float32)).astype(streams.dtype)


def hc_weights(p: Params, streams: jax.Array, cfg: HcShape) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(post [b, s, hc], comb [b, s, hc, hc], the block's input [b, s, hidden])`` of ``streams``."""
    n, eps = cfg.hc_mult, cfg.hc_eps
    mixes = _mixes(streams, p["fn"], cfg.rms_norm_eps)
    base, scale = p["base"].astype(jnp.float32), p["scale"].astype(jnp.float32)
    pre = jax.nn.sigmoid(mixes[..., :n] * scale[0] + base[:n]) + eps
    post = 2 * jax.nn.sigmoid(mixes[..., n : 2 * n] * scale[1] + base[n : 2 * n])
    comb_logits = mixes[..., 2 * n :].reshape(*mixes.shape[:2], n, n) * scale[2] + base[2 * n :].reshape(n, n)
    comb = jax.nn.softmax(comb_logits, axis=-1) + eps
    comb = comb / (comb.sum(-2, keepdims=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdims=True) + eps)
        comb = comb / (comb.sum(-2, keepdims=True) + eps)
    return post, comb, _collapse(pre, streams)


def hc_merge(post: jax.Array, comb: jax.Array, out: jax.Array, streams: jax.Array) -> jax.Array:
    """The new streams: ``post_k * out + sum_j comb[j, k] * streams_j``."""
    dtype = streams.dtype
    carried = jnp.einsum("bsjk,bsjd->bskd", comb.astype(dtype), streams)
    return post.astype(dtype)[..., None] * out[:, :, None, :] + carried


def hc_head(p: Params, streams: jax.Array, cfg: HcShape) -> jax.Array:
    """The streams collapsed into one ``[b, s, hidden]`` by the head's ``pre`` weights."""
    mixes = _mixes(streams, p["fn"], cfg.rms_norm_eps)
    pre = jax.nn.sigmoid(mixes * p["scale"].astype(jnp.float32) + p["base"].astype(jnp.float32)) + cfg.hc_eps
    return _collapse(pre, streams)
