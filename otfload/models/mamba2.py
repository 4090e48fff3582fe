"""The Mamba-2 mixer (Nemotron-H): a selective state-space recurrence after a causal depthwise
convolution, linear in the sequence.

A layer projects the normed input (``in_proj``) to the gate ``z`` (``heads * head_dim`` channels),
the convolution's channels ``xBC`` (the values ``x``, then ``n_groups`` input and output projections
``B`` and ``C`` of ``ssm_state_size`` each) and one time step ``dt`` per head; ``xBC`` runs through a
causal depthwise conv1d of ``conv_kernel`` taps (with its bias) and SiLU, then per head ``h`` (of
group ``h // (heads / n_groups)``) the recurrence::

    S_t = exp(dt_t A) S_{t-1} + dt_t x_t B_t^T,     y_t = S_t C_t + D x_t

with ``S`` a ``[head_dim, ssm_state_size]`` state, ``A = -exp(A_log)`` and ``dt = softplus(dt +
dt_bias)``, at least ``time_step_min`` where transformers clamps it (every call but a one-token
decoding step, as transformers' and mamba_ssm's step kernels leave it unclamped). The output is
``y * SiLU(z)`` RMS-normed per group of ``heads * head_dim / n_groups`` channels, then ``out_proj``.

:func:`ssd` computes the recurrence in chunks of ``chunk`` tokens (the state-space duality form):
within a chunk densely (the decays between every pair of tokens, a ``[chunk, chunk]`` matrix), across
chunks by carrying ``S`` in a ``lax.scan``. A chunk as long as the sequence is the quadratic form;
:func:`recurrent_ssd` is the same recurrence token by token. All of it runs in float32 whatever the
weights' dtype. Padding (``mask`` 0) never enters a convolution window or the state: a pad token's
projections are zeroed before and after the convolution, its time step is 0 (decay 1, no write).

The cache of a layer (decoding), as transformers keeps it: ``conv [b, conv_dim, K]``, the last ``K``
conv inputs (in the activation dtype), and ``state [b, heads, head_dim, ssm_state_size]`` in float32.
"""

from __future__ import annotations

from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.base import GroupCache
from otfload.models.gated_delta import causal_conv1d
from otfload.models.layers import Dense, Norm, ParamOptions, Params, dense, make_param


class Mamba2Shape(Protocol):
    """The config fields a Mamba-2 layer reads (transformers' names)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def mamba_num_heads(self) -> int: ...
    @property
    def mamba_head_dim(self) -> int: ...
    @property
    def n_groups(self) -> int: ...
    @property
    def ssm_state_size(self) -> int: ...
    @property
    def conv_kernel(self) -> int: ...
    @property
    def use_conv_bias(self) -> bool: ...
    @property
    def use_bias(self) -> bool: ...
    @property
    def chunk_size(self) -> int: ...
    @property
    def time_step_min(self) -> float: ...
    @property
    def layer_norm_epsilon(self) -> float: ...


def inner_dim(cfg: Mamba2Shape) -> int:
    """Channels of ``x`` and of the gate: ``heads * head_dim``."""
    return cfg.mamba_num_heads * cfg.mamba_head_dim


def conv_dim(cfg: Mamba2Shape) -> int:
    """Channels of the convolution: ``x``, then ``B`` and ``C`` of every group."""
    return inner_dim(cfg) + 2 * cfg.n_groups * cfg.ssm_state_size


class Mamba2(nnx.Module):
    """``in_proj (inner + conv_dim + heads, hidden)`` (z, xBC, dt rows, as HF fuses them), ``conv
    (conv_dim, 1, K)`` and ``conv_bias (conv_dim,)`` (HF's depthwise ``conv1d``), ``dt_bias``/``A_log``/
    ``D (heads,)``, the gated ``norm (inner,)`` and ``out_proj (hidden, inner)``."""

    def __init__(
        self, cfg: Mamba2Shape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        h, heads, inner, c = cfg.hidden_size, cfg.mamba_num_heads, inner_dim(cfg), conv_dim(cfg)
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        bias = (0,) if cfg.use_bias else ()
        self.in_proj = Dense((inner + c + heads, h), ("mlp", "embed"), bias_dims=bias, **kw)
        self.conv = make_param(rngs, (c, 1, cfg.conv_kernel), ("mlp", None, None), dtype, stack)
        if cfg.use_conv_bias:
            self.conv_bias = make_param(rngs, (c,), ("mlp",), dtype, stack)
        self.dt_bias = make_param(rngs, (heads,), ("heads",), dtype, stack)
        self.A_log = make_param(rngs, (heads,), ("heads",), dtype, stack)
        self.D = make_param(rngs, (heads,), ("heads",), dtype, stack)
        self.norm = Norm(inner, **kw)
        self.out_proj = Dense((h, inner), ("embed", "mlp"), bias_dims=bias, **kw)


def ssd(
    x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array, state: jax.Array | None, chunk: int
) -> tuple[jax.Array, jax.Array]:
    """The recurrence over ``x [bs, s, h, p]``, time steps ``dt [bs, s, h]``, ``a [h]`` (negative) and
    the groups' ``b``/``c [bs, s, g, n]`` (head ``i`` reads group ``i // (h / g)``), from ``state [bs,
    h, p, n]`` (zeros when None), in chunks of ``chunk`` tokens: ``(y [bs, s, h, p] without the D
    term, final state)``, float32.

    Within a chunk, with ``G_i`` the sum of ``dt a`` from the chunk's start to token ``i`` and ``S_0``
    the state before it: ``y_i = exp(G_i) S_0 c_i + sum_{j<=i} exp(G_i - G_j) (c_i . b_j) dt_j x_j``,
    and the state after the chunk is ``exp(G_C) S_0 + sum_j exp(G_C - G_j) dt_j x_j b_j^T``. Each
    chunk's work runs inside the ``lax.scan`` step, so its ``[chunk, chunk]`` matrices exist for one
    chunk at a time (memory and time linear in the sequence), and ``c . b`` once per group."""
    bs, s, h, p = x.shape
    g, n_state = b.shape[2], b.shape[3]
    r = h // g
    size = max(1, min(chunk, s))
    n = -(-s // size)
    pad = n * size - s

    def chunks(t: jax.Array) -> jax.Array:  # [bs, s, k, ...] -> [n, bs, k, size, ...], zero-padded
        t = jnp.pad(t.astype(jnp.float32), [(0, 0), (0, pad)] + [(0, 0)] * (t.ndim - 2))
        t = t.reshape(bs, n, size, t.shape[2], *t.shape[3:])
        return jnp.moveaxis(jnp.moveaxis(t, 3, 2), 1, 0)

    x, dt, b, c = (chunks(t) for t in (x, dt, b, c))  # a padded token: dt 0, x 0 (no decay, no write)
    cum = jnp.cumsum(dt * a.astype(jnp.float32)[:, None], axis=-1)  # [n, bs, h, size]
    lower = jnp.tril(jnp.ones((size, size), bool))

    def step(s0: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        xk, dtk, bk, ck, gk = xs  # one chunk: [bs, h, size, p], [bs, h, size], [bs, g, size, n] x2, [bs, h, size]
        # exp(G_i - G_j) where j <= i, else 0 (masked before exp: no overflow above the diagonal).
        decay = jnp.exp(jnp.where(lower, gk[..., :, None] - gk[..., None, :], -jnp.inf))
        scores = jnp.einsum("bgin,bgjn->bgij", ck, bk)[:, :, None] * (decay * dtk[..., None, :]).reshape(
            bs, g, r, size, size)
        grouped = (bs, g, r, size, p)
        within = jnp.einsum("bgrij,bgrjp->bgrip", scores, xk.reshape(grouped))
        from_state = jnp.einsum("bgin,bgrpn->bgrip", ck, s0.reshape(bs, g, r, p, n_state))
        y = within + from_state * jnp.exp(gk).reshape(bs, g, r, size, 1)
        written = (xk * (jnp.exp(gk[..., -1:] - gk) * dtk)[..., None]).reshape(grouped)
        writes = jnp.einsum("bgrjp,bgjn->bgrpn", written, bk).reshape(s0.shape)
        return s0 * jnp.exp(gk[..., -1])[..., None, None] + writes, y.reshape(bs, h, size, p)

    s0 = jnp.zeros((bs, h, p, n_state), jnp.float32) if state is None else state.astype(jnp.float32)
    final, out = jax.lax.scan(step, s0, (x, dt, b, c, cum))
    out = jnp.moveaxis(out, 0, 1).swapaxes(2, 3).reshape(bs, n * size, h, p)[:, :s]
    return out, final


def recurrent_ssd(
    x: jax.Array, dt: jax.Array, a: jax.Array, b: jax.Array, c: jax.Array, state: jax.Array | None
) -> tuple[jax.Array, jax.Array]:
    """:func:`ssd` one token at a time (same arguments and results): the recurrence as written (a
    reference; ``mamba2_forward(..., chunk=0)``)."""
    bs, s, h, p = x.shape
    b, c = (jnp.repeat(t, h // t.shape[2], axis=2) for t in (b, c))
    s0 = jnp.zeros((bs, h, p, b.shape[-1]), jnp.float32) if state is None else state.astype(jnp.float32)
    a = a.astype(jnp.float32)

    def step(st: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        xt, dtt, bt, ct = xs
        st = st * jnp.exp(dtt * a)[..., None, None] + (dtt[..., None] * xt)[..., :, None] * bt[..., None, :]
        return st, jnp.einsum("bhpn,bhn->bhp", st, ct)

    final, out = jax.lax.scan(step, s0, tuple(jnp.moveaxis(t.astype(jnp.float32), 1, 0) for t in (x, dt, b, c)))
    return jnp.moveaxis(out, 0, 1), final


def gated_group_norm(y: jax.Array, gate: jax.Array, scale: jax.Array, groups: int, eps: float) -> jax.Array:
    """``y * SiLU(gate)`` RMS-normed over each of ``groups`` equal runs of its last axis, times
    ``scale``; all in float32 (transformers' ``NemotronHRMSNormGated`` on the float32 scan output)."""
    g = y.astype(jnp.float32) * jax.nn.silu(gate.astype(jnp.float32))
    grouped = g.reshape(*g.shape[:-1], groups, -1)
    normed = grouped * jax.lax.rsqrt(jnp.mean(grouped * grouped, axis=-1, keepdims=True) + eps)
    return scale.astype(jnp.float32) * normed.reshape(g.shape)


def mamba2_forward(
    p: Params, h: jax.Array, cfg: Mamba2Shape, mask: jax.Array | None, cache: GroupCache | None,
    chunk: int | None = None,
) -> tuple[jax.Array, GroupCache | None]:
    """The mixer on the normed input ``h [b, s, hidden]`` (``mask [b, s]``: 1 = token, None: all are)
    from a layer's ``cache`` (``{"conv", "state"}``, None: no cache): ``(output, updated cache)``.
    ``chunk`` is the recurrence's chunk length (None: the config's ``chunk_size``; 0: token by token)."""
    bs, s, _ = h.shape
    heads, hd, groups, n = cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.n_groups, cfg.ssm_state_size
    inner = inner_dim(cfg)
    keep = None if mask is None else mask[..., None].astype(h.dtype)
    if keep is not None:
        h = h * keep
    z, xbc, dt = jnp.split(dense(p["in_proj"], h, "bsh,ph->bsp"), [inner, inner + conv_dim(cfg)], axis=-1)
    if keep is not None:  # with an in_proj bias a pad's projection is not zero
        xbc = xbc * keep
    xbc, conv_state = causal_conv1d(xbc, p["conv"][:, 0], None if cache is None else cache["conv"], p.get("conv_bias"))
    if keep is not None:
        xbc = xbc * keep
    x, b, c = jnp.split(xbc, [inner, inner + groups * n], axis=-1)
    dt = jax.nn.softplus(dt.astype(jnp.float32) + p["dt_bias"].astype(jnp.float32))
    if cache is None or s > 1:
        dt = jnp.maximum(dt, cfg.time_step_min)
    if mask is not None:
        dt = jnp.where(mask[..., None].astype(bool), dt, 0.0)
    a = -jnp.exp(p["A_log"].astype(jnp.float32))
    x = x.reshape(bs, s, heads, hd).astype(jnp.float32)
    b, c = (t.reshape(bs, s, groups, n).astype(jnp.float32) for t in (b, c))
    initial = None if cache is None else cache["state"]
    size = cfg.chunk_size if chunk is None else chunk
    y, state = ssd(x, dt, a, b, c, initial, size) if size else recurrent_ssd(x, dt, a, b, c, initial)
    y = y + p["D"].astype(jnp.float32)[:, None] * x
    y = gated_group_norm(y.reshape(bs, s, inner), z, p["norm"]["scale"], groups, cfg.layer_norm_epsilon)
    new = None if cache is None else {"conv": conv_state.astype(cache["conv"].dtype), "state": state}
    return dense(p["out_proj"], y.astype(h.dtype), "bsm,hm->bsh"), new
