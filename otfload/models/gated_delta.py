"""The Gated DeltaNet mixer (Qwen3.5, Qwen3-Next): linear attention by a gated delta-rule recurrence
after a causal depthwise convolution, linear in the sequence.

A layer projects the normed input to the fused ``qkv`` channels (query and key heads of ``dk``, value
heads of ``dv``), the output gate ``z`` and the per-value-head ``a`` (decay) and ``b`` (write
strength); ``qkv`` runs through a causal depthwise conv1d of ``K`` taps and SiLU, then the recurrence
per value head (each key head serves ``hv / hk`` consecutive value heads)::

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - exp(g_t) S_{t-1}^T k_t))^T,     o_t = S_t^T q_t

with ``S`` a ``[dk, dv]`` state, q and k L2-normed (q also by ``dk**-0.5``), ``g = -exp(A_log)
softplus(a + dt_bias)`` and ``beta = sigmoid(b)``; the output is RMSNorm(o) * SiLU(z), projected back.

:func:`gated_delta_rule` computes the recurrence in chunks of ``chunk`` tokens: within a chunk
densely (the delta rule's updates folded into one unit lower-triangular solve, the WY form), across
chunks by carrying ``S`` in a ``lax.scan``. The decay is one per head and token (``g [b, s, h]``, as
here) or one per key channel (``g [b, s, h, dk]``: Kimi Delta Attention,
:mod:`otfload.models.kimi_delta`), ``exp(g_t)`` then scaling the rows of ``S``. A chunk as long as
the sequence is the quadratic form; :func:`recurrent_gated_delta_rule` is the same recurrence token
by token. All of it runs in float32
whatever the weights' dtype. Padding (``mask`` 0) never enters a convolution window or the state:
a pad token's input is zeroed, its decay is 1 and its write strength 0.

Qwen3.5 stores the projections apart (``in_proj_qkv`` fused by kind: every query head, then every
key head, then every value head); Qwen3-Next fuses them per key head (``in_proj_qkvz``: each key
head's query, key, value and ``z`` rows together; ``in_proj_ba`` its ``b`` then ``a`` rows), which
``per_key_head`` keeps as the layer's ``q``, ``k``, ``v``, ``z``, ``b`` and ``a`` by key head, and
the convolution's taps too (``conv_q``, ``conv_k``, ``conv_v``), so that the convolution runs on
each key head's channels where its projections are: on a mesh sharding the heads no channel moves
between devices. (Concatenating the three kinds' sharded channels into the fused layout and
splitting them after the convolution made the partitioner exchange rows by collective-permutes
among some devices only; with the chunked scan after them, XLA:CPU 0.10's concurrency-optimized
scheduler then never returned from the program: every device waiting, no CPU used.)

The cache of a layer (decoding): ``conv [b, conv_dim, K]``, the last ``K`` conv inputs (in the
activation dtype, as transformers keeps them; ``per_key_head``: the channels by key head, each
head's query, key and value channels together), and ``state [b, hv, dk, dv]`` in float32.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.base import GroupCache
from otfload.models.layers import Dense, Norm, ParamOptions, Params, dense, make_param

# Tokens per chunk of the chunked recurrence (transformers' and flash-linear-attention's default).
CHUNK = 64
# transformers' l2norm epsilon (inside the square root).
L2_EPS = 1e-6
# The most values of the per-channel decay factors [c, c, dk] made at once (16 MiB of float32).
FACTOR_ELEMENTS = 1 << 22


class GatedDeltaShape(Protocol):
    """The config fields a Gated DeltaNet layer reads."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def linear_num_key_heads(self) -> int: ...
    @property
    def linear_num_value_heads(self) -> int: ...
    @property
    def linear_key_head_dim(self) -> int: ...
    @property
    def linear_value_head_dim(self) -> int: ...
    @property
    def linear_conv_kernel_dim(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...


def conv_dim(cfg: GatedDeltaShape) -> int:
    """Channels of the fused ``qkv`` projection and of the convolution: query, key, value."""
    keys = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    return 2 * keys + cfg.linear_num_value_heads * cfg.linear_value_head_dim


class GatedDeltaNet(nnx.Module):
    """``qkv (conv_dim, hidden)``, ``conv (conv_dim, 1, K)`` (as HF's depthwise ``conv1d`` stores it),
    ``z (hv, dv, hidden)``, ``a``/``b (hv, hidden)``, ``dt_bias``/``A_log (hv,)``, the gated ``norm
    (dv,)`` and ``out (hidden, hv, dv)``. ``per_key_head`` (Qwen3-Next) replaces ``qkv``, ``conv``,
    ``z``, ``a`` and ``b`` by ``q``/``k (hk, dk, hidden)``, ``v``/``z (hk, r * dv, hidden)``,
    ``b``/``a (hk, r, hidden)`` and the taps of the query, key and value channels ``conv_q``/``conv_k
    (hk, dk, 1, K)``, ``conv_v (hk, r * dv, 1, K)``, ``r = hv / hk`` value heads per key head."""

    def __init__(
        self, cfg: GatedDeltaShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None,
        per_key_head: bool = False,
    ) -> None:
        h, hv, dv = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        c = conv_dim(cfg)
        if per_key_head:
            hk, dk = cfg.linear_num_key_heads, cfg.linear_key_head_dim
            r, axes = hv // hk, ("heads", "head_dim", "embed")
            self.q = Dense((hk, dk, h), axes, **kw)
            self.k = Dense((hk, dk, h), axes, **kw)
            self.v = Dense((hk, r * dv, h), axes, **kw)
            self.z = Dense((hk, r * dv, h), axes, **kw)
            self.b = Dense((hk, r, h), axes, **kw)
            self.a = Dense((hk, r, h), axes, **kw)
            taps, conv_axes = (1, cfg.linear_conv_kernel_dim), ("heads", "head_dim", None, None)
            self.conv_q = make_param(rngs, (hk, dk, *taps), conv_axes, dtype, stack)
            self.conv_k = make_param(rngs, (hk, dk, *taps), conv_axes, dtype, stack)
            self.conv_v = make_param(rngs, (hk, r * dv, *taps), conv_axes, dtype, stack)
        else:
            self.qkv = Dense((c, h), ("mlp", "embed"), **kw)
            self.z = Dense((hv, dv, h), ("heads", "head_dim", "embed"), **kw)
            self.a = Dense((hv, h), ("heads", "embed"), **kw)
            self.b = Dense((hv, h), ("heads", "embed"), **kw)
            self.conv = make_param(rngs, (c, 1, cfg.linear_conv_kernel_dim), ("mlp", None, None), dtype, stack)
        self.dt_bias = make_param(rngs, (hv,), ("heads",), dtype, stack)
        self.A_log = make_param(rngs, (hv,), ("heads",), dtype, stack)
        self.norm = Norm(dv, **kw)
        self.out = Dense((h, hv, dv), ("embed", "heads", "head_dim"), **kw)


def causal_conv1d(
    x: jax.Array, weight: jax.Array, state: jax.Array | None, bias: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """Causal depthwise convolution of ``x [b, s, c]`` with ``weight [c, K]`` (plus ``bias [c]``) after
    the previous inputs ``state [b, c, K]`` (zeros when None), then SiLU: ``(y [b, s, c], the last K
    inputs [b, c, K])``. ``y[t] = sum_j weight[:, j] * input[t - K + 1 + j]``, accumulated in float32."""
    b, s, c = x.shape
    taps = weight.shape[-1]
    past = jnp.zeros((b, c, taps), x.dtype) if state is None else state.astype(x.dtype)
    inputs = jnp.concatenate([jnp.swapaxes(past, 1, 2), x], axis=1)  # [b, K + s, c]
    w = weight.astype(jnp.float32)
    y = sum(inputs[:, 1 + j: 1 + j + s].astype(jnp.float32) * w[:, j] for j in range(taps))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return jax.nn.silu(y).astype(x.dtype), jnp.swapaxes(inputs[:, -taps:], 1, 2)


def l2_normalize(x: jax.Array) -> jax.Array:
    """``x / sqrt(sum(x**2) + eps)`` over the last axis, as transformers' ``l2norm``."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2_EPS)


def _decayed_products(cum: jax.Array) -> Callable[[jax.Array, jax.Array, bool], jax.Array]:
    """``products(a, b, strict) [..., c, c]``: ``sum_d a_i,d b_j,d exp(cum_i,d - cum_j,d)`` where ``j <=
    i`` (``j < i`` when ``strict``), else 0, for the chunk-wise log decays ``cum [..., c, 1 or dk]``
    summed from the chunk's start, ``[n, ...]`` over ``n`` chunks. The exponent is masked before ``exp``
    (no overflow above the diagonal), and taken per pair, never split into ``exp(cum_i) exp(-cum_j)``
    (which overflows); per channel the ``[c, c, dk]`` factors are made a few (chunk, row, head) at a
    time, at most :data:`FACTOR_ELEMENTS` values together, so they never exist for the whole sequence
    (made whole, the factor of one 256-token chunk of 8 heads of 64, 2**25 values, gave wrong products
    under XLA:CPU 0.10)."""
    c = cum.shape[-2]
    lower = jnp.tril(jnp.ones((c, c), bool))
    off = 1 - jnp.eye(c, dtype=jnp.float32)
    if cum.shape[-1] == 1:  # one decay per head: a [c, c] factor of the plain products
        decay = jnp.exp(jnp.where(lower, cum[..., :, None, 0] - cum[..., None, :, 0], -jnp.inf))

        def per_head(a: jax.Array, b: jax.Array, strict: bool) -> jax.Array:
            return jnp.einsum("...id,...jd->...ij", a, b) * (decay * off if strict else decay)

        return per_head

    def one_block(xs: tuple[jax.Array, jax.Array, jax.Array]) -> jax.Array:  # one (chunk, row, head)
        a, b, g = xs
        decay = jnp.exp(jnp.where(lower[..., None], g[:, None, :] - g[None, :, :], -jnp.inf))
        return jnp.einsum("id,jd,ijd->ij", a, b, decay)

    def per_channel(a: jax.Array, b: jax.Array, strict: bool) -> jax.Array:
        blocks = tuple(x.reshape(-1, *x.shape[-2:]) for x in (a, b, cum))
        batch = max(1, min(len(blocks[0]), FACTOR_ELEMENTS // (c * c * cum.shape[-1])))
        out: jax.Array = jax.lax.map(one_block, blocks, batch_size=batch).reshape(*a.shape[:-1], c)
        return out * off if strict else out

    return per_channel


def unit_lower_inverse(m: jax.Array) -> jax.Array:
    """The inverse of the unit lower-triangular ``m [..., c, c]``, by doubling blocks: the inverses
    of the diagonal blocks of width ``w`` give those of width ``2 w`` (``[[A, 0], [C, D]]^-1 = [[A^-1,
    0], [-D^-1 C A^-1, D^-1]]``), ``log2 c`` rounds of batched matmuls; ``c`` is padded to a power of
    two by an identity block.

    Not ``lax.linalg.triangular_solve``: on XLA:CPU (jaxlib 0.10) its LAPACK kernel splits a batch
    over the intra-op thread pool and waits for the parts inside a thread of that same pool, so when
    every simulated device of a mesh runs one at once they wait on each other forever (the pool's
    threads all in ``ParallelBatchMap``, no CPU used)."""
    c = m.shape[-1]
    size = 1 << (c - 1).bit_length()
    batch = m.shape[:-2]
    m = jnp.pad(m, [(0, 0)] * len(batch) + [(0, size - c)] * 2) + jnp.diag(jnp.arange(size) >= c).astype(m.dtype)
    inv = jnp.ones((*batch, size, 1, 1), m.dtype)  # the inverses of the diagonal blocks, width 1
    width = 1
    while width < size:
        n = size // (2 * width)
        diagonal = jnp.diagonal(m.reshape(*batch, n, 2 * width, n, 2 * width), axis1=-4, axis2=-2)
        corner = jnp.moveaxis(diagonal, -1, -3)[..., width:, :width]  # C of each block of width 2w
        top, bottom = inv[..., 0::2, :, :], inv[..., 1::2, :, :]
        lower = -(bottom @ corner @ top)
        inv = jnp.concatenate([jnp.concatenate([top, jnp.zeros_like(lower)], axis=-1),
                               jnp.concatenate([lower, bottom], axis=-1)], axis=-2)
        width *= 2
    return inv[..., 0, :c, :c]


def gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array | None,
    chunk: int = CHUNK,
) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule over ``q, k [b, s, h, dk]``, ``v [b, s, h, dv]``, log decays ``g [b, s,
    h]`` (per head) or ``[b, s, h, dk]`` (per key channel) and write strengths ``beta [b, s, h]`` (q/k
    normed and scaled by the caller), from ``state [b, h, dk, dv]`` (zeros when None), in chunks of
    ``chunk`` tokens: ``(o [b, s, h, dv], final state)``, float32.

    Within a chunk, with ``G_i`` the decay summed from the chunk's start to token ``i`` (per channel
    ``d`` where the decay is), ``S_0`` the state before it and ``<a, b>_ij = sum_d a_d b_d exp(G_i,d -
    G_j,d)``, the writes ``u_i = beta_i (v_i - S_0^T (exp(G_i) k_i) - sum_{j<i} <k_i, k_j>_ij u_j)``
    solve one unit lower-triangular system; then ``o_i = S_0^T (exp(G_i) q_i) + sum_{j<=i} <q_i,
    k_j>_ij u_j`` and the state after the chunk is ``exp(G_C) S_0 + sum_j (exp(G_C - G_j) k_j)
    u_j^T``."""
    b, s, h, dk = k.shape
    dv = v.shape[-1]
    c = max(1, min(chunk, s))
    n = -(-s // c)
    pad = n * c - s

    def chunks(x: jax.Array) -> jax.Array:  # [b, s, h, ...] -> [n, b, h, c, ...], zero-padded
        x = jnp.pad(x.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        x = x.reshape(b, n, c, h, *x.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(x, 3, 2), 1, 0)

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g if g.ndim == 4 else g[..., None], beta))
    cum = jnp.cumsum(g, axis=-2)  # [n, b, h, c, 1 or dk]
    products = _decayed_products(cum)
    system = jnp.eye(c, dtype=jnp.float32) + beta[..., :, None] * products(k, k, True)
    rhs = jnp.concatenate([beta[..., None] * v, beta[..., None] * jnp.exp(cum) * k], axis=-1)
    solved = unit_lower_inverse(system) @ rhs
    writes, state_weights = solved[..., :dv], solved[..., dv:]  # u = writes - state_weights @ S_0
    scores = products(q, k, False)
    q_decayed = q * jnp.exp(cum)
    k_to_end = k * jnp.exp(cum[..., -1:, :] - cum)
    end_decay = jnp.exp(cum[..., -1, :])[..., None]  # scales S_0's rows: [..., 1 or dk, 1]

    def step(s0: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        w, sw, sc, qd, kd, ed = xs
        u = w - sw @ s0
        out = qd @ s0 + sc @ u
        return s0 * ed + jnp.swapaxes(kd, -1, -2) @ u, out

    s0 = jnp.zeros((b, h, dk, dv), jnp.float32) if state is None else state.astype(jnp.float32)
    final, out = jax.lax.scan(step, s0, (writes, state_weights, scores, q_decayed, k_to_end, end_decay))
    out = jnp.moveaxis(out, 0, 1).swapaxes(2, 3).reshape(b, n * c, h, dv)[:, :s]
    return out, final


def recurrent_gated_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, state: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """:func:`gated_delta_rule` one token at a time (same arguments and results): the recurrence as
    written (a reference; ``gated_delta_forward(..., chunk=0)``)."""
    b, s, h, dk = k.shape
    s0 = jnp.zeros((b, h, dk, v.shape[-1]), jnp.float32) if state is None else state.astype(jnp.float32)

    def step(st: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        qt, kt, vt, gt, bt = xs
        st = st * jnp.exp(gt)[..., None]
        delta = (vt - jnp.einsum("bhkv,bhk->bhv", st, kt)) * bt[..., None]
        st = st + kt[..., :, None] * delta[..., None, :]
        return st, jnp.einsum("bhkv,bhk->bhv", st, qt)

    g = g if g.ndim == 4 else g[..., None]
    xs = tuple(jnp.moveaxis(x.astype(jnp.float32), 1, 0) for x in (q, k, v, g, beta))
    final, out = jax.lax.scan(step, s0, xs)
    return jnp.moveaxis(out, 0, 1), final


def masked_delta_rule(
    q: jax.Array, k: jax.Array, v: jax.Array, g: jax.Array, beta: jax.Array, mask: jax.Array | None,
    state: jax.Array | None, chunk: int,
) -> tuple[jax.Array, jax.Array]:
    """:func:`gated_delta_rule` in chunks of ``chunk`` tokens (0: :func:`recurrent_gated_delta_rule`)
    with the pads of ``mask [b, s]`` (0; None: no pads) kept out of the state: their decay is 1 (``g``
    0) and their write strength 0."""
    if mask is not None:
        keep = mask.astype(bool)
        g = jnp.where(keep.reshape(*keep.shape, *(1,) * (g.ndim - 2)), g, 0.0)
        beta = jnp.where(keep[..., None], beta, 0.0)
    if chunk:
        return gated_delta_rule(q, k, v, g, beta, state, chunk)
    return recurrent_gated_delta_rule(q, k, v, g, beta, state)


def gated_rms_norm(x: jax.Array, gate: jax.Array, scale: jax.Array, eps: float, dtype: DTypeLike) -> jax.Array:
    """RMSNorm of ``x`` (float32, the scale applied in ``dtype``) times SiLU of ``gate``, in ``dtype``."""
    x32 = x.astype(jnp.float32)
    normed = (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)).astype(dtype)
    return (scale.astype(dtype) * normed * jax.nn.silu(gate.astype(jnp.float32))).astype(dtype)


def by_heads(p: Params, h: jax.Array, heads: tuple[int, ...]) -> jax.Array:
    """A projection of ``h [b, s, hidden]`` whatever its kernel's head layout (``[..., hidden]``),
    reshaped to ``[b, s, *heads]``."""
    return dense(p, h, "bsh,...h->bs...").reshape(*h.shape[:2], *heads)


def gated_delta_forward(
    p: Params, h: jax.Array, cfg: GatedDeltaShape, mask: jax.Array | None, cache: GroupCache | None,
    chunk: int = CHUNK,
) -> tuple[jax.Array, GroupCache | None]:
    """The mixer on the normed input ``h [b, s, hidden]`` (``mask [b, s]``: 1 = token, None: all are)
    from a layer's ``cache`` (``{"conv", "state"}``, None: no cache): ``(output, updated cache)``.
    ``chunk`` is the recurrence's chunk length; 0 runs it token by token."""
    b, s, _ = h.shape
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    if mask is not None:
        h = h * mask[..., None].astype(h.dtype)
    past = None if cache is None else cache["conv"]
    if "qkv" in p:
        mixed, conv_state = causal_conv1d(dense(p["qkv"], h, "bsh,ch->bsc"), p["conv"][:, 0], past)
        q, k, v = jnp.split(mixed, [hk * dk, 2 * hk * dk], axis=-1)
    else:  # by key head: each head's query, key and value channels side by side, on its device
        qkv = jnp.concatenate([by_heads(p[name], h, (hk, -1)) for name in ("q", "k", "v")], axis=-1)
        taps = jnp.concatenate([p[f"conv_{name}"][:, :, 0] for name in ("q", "k", "v")], axis=1)
        mixed, conv_state = causal_conv1d(qkv.reshape(b, s, -1), taps.reshape(-1, taps.shape[-1]), past)
        q, k, v = jnp.split(mixed.reshape(qkv.shape), [dk, 2 * dk], axis=-1)
    q, k = (l2_normalize(x.reshape(b, s, hk, dk).astype(jnp.float32)) for x in (q, k))
    q, k = (jnp.repeat(x, hv // hk, axis=2) for x in (q * dk**-0.5, k))
    a = by_heads(p["a"], h, (hv,)).astype(jnp.float32)
    g = -jnp.exp(p["A_log"].astype(jnp.float32)) * jax.nn.softplus(a + p["dt_bias"].astype(jnp.float32))
    beta = jax.nn.sigmoid(by_heads(p["b"], h, (hv,)).astype(jnp.float32))
    out, state = masked_delta_rule(q, k, v.reshape(b, s, hv, dv), g, beta, mask,
                                   None if cache is None else cache["state"], chunk)
    z = by_heads(p["z"], h, (hv, dv))
    out = gated_rms_norm(out, z, p["norm"]["scale"], cfg.rms_norm_eps, h.dtype)
    new = None if cache is None else {"conv": conv_state.astype(cache["conv"].dtype), "state": state}
    return dense(p["out"], out, "bsnd,hnd->bsh"), new
