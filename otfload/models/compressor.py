"""DeepSeek-V4's window compressors (CSA, HCA and the CSA indexer's): each full window of ``rate``
tokens pooled into one key, and the state that lets a KV cache emit the windows as tokens arrive.

A compressor projects each token to ``series * dim`` values ``kv`` and a gate (``series`` 2 for CSA's
overlapping windows, 1 for HCA); window ``w`` is the softmax (over its tokens, per dim, the gate plus
the learned ``ape`` of each token's place in the window) pooled ``kv``, RMS-normalised, then rotated
at position ``w * rate``. With overlap, window ``w`` pools window ``w - 1``'s first series with its own
second one (window 0's predecessor gets weight 0), as transformers 5.24's ``DeepseekV4CSACompressor``.

Without a cache (:func:`compressed_keys`) the windows are cut from the call's slot 0, as transformers'
forward does (pads included). With one (:func:`cached_keys`), windows are cut from each row's *real*
tokens, counted on from the ones already cached, so a left-padded row gets the windows it gets alone;
the cache keeps per compressor ``windows`` ``[b, slots // rate, dim]`` (rotated, each written once,
when its last token arrives) and the projections of the tokens not yet pooled (``pool_kv`` and
``pool_gate``, ``[b, series * rate, series * dim]``: the open window and, with overlap, the last full
one, aligned to a window boundary), as transformers' ``DeepseekV4CSACache`` keeps its buffer,
overlap state and compressed entries.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from otfload.models.base import GroupCache
from otfload.models.layers import Params, dense, rms_norm_scaled_f32


class Rotary(NamedTuple):
    """One RoPE: inverse frequencies (one per rotated pair) and the factor cos/sin are scaled by."""

    inv_freq: np.ndarray
    scale: float

    def tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(cos, sin)`` at ``positions [b, n]``: ``[b, n, pairs]`` each."""
        freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(self.inv_freq)
        return jnp.cos(freqs) * self.scale, jnp.sin(freqs) * self.scale


class Spec(NamedTuple):
    """One compressor's shape: window ``rate``, key ``dim``, overlapping windows (CSA) or not, the
    RoPE its windows are rotated by, the norm's ``eps``."""

    rate: int
    dim: int
    overlap: bool
    rope: Rotary
    eps: float

    @property
    def series(self) -> int:
        return 2 if self.overlap else 1


def rope_tail(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Interleaved-pair RoPE on the last ``2 * cos.shape[-1]`` dims of ``x [b, s, heads, d]``
    (``cos``/``sin`` ``[b, s, pairs]``); the leading dims pass through."""
    pairs = cos.shape[-1]
    keep, rot = x[..., : -2 * pairs], x[..., -2 * pairs :].astype(jnp.float32)
    rot = rot.reshape(*rot.shape[:-1], pairs, 2)
    c, s = cos[:, :, None, :], sin[:, :, None, :]
    even, odd = rot[..., 0], rot[..., 1]
    rotated = jnp.stack([even * c - odd * s, odd * c + even * s], axis=-1).reshape(*x.shape[:-1], 2 * pairs)
    return jnp.concatenate([keep, rotated.astype(x.dtype)], axis=-1)


def _project(p: Params, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Each token's ``kv`` (``x``'s dtype) and gate (float32, without ``ape``): ``[b, s, series * dim]``."""
    return dense(p["kv"], x, "bsh,oh->bso"), dense(p["gate"], x, "bsh,oh->bso").astype(jnp.float32)


def _pool(p: Params, kv: jax.Array, gate: jax.Array, spec: Spec) -> jax.Array:
    """The normalised (not yet rotated) windows of ``kv``/``gate`` ``[b, n * rate, series * dim]``, cut
    from their first token: ``[b, n, dim]``."""
    b, dim, rate = kv.shape[0], spec.dim, spec.rate
    kv = kv.reshape(b, -1, rate, kv.shape[-1])
    gate = gate.reshape(kv.shape) + p["ape"].astype(jnp.float32)
    if spec.overlap:  # window w pools window w - 1's first series with its own second one
        first_kv = jnp.pad(kv[:, :-1, :, :dim], ((0, 0), (1, 0), (0, 0), (0, 0)))
        first_gate = jnp.pad(gate[:, :-1, :, :dim], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
        kv = jnp.concatenate([first_kv, kv[..., dim:]], axis=2)
        gate = jnp.concatenate([first_gate, gate[..., dim:]], axis=2)
    weights = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
    return rms_norm_scaled_f32((kv * weights).sum(axis=2), p["norm"]["scale"], spec.eps)


def _rotate(keys: jax.Array, first: jax.Array, spec: Spec) -> jax.Array:
    """``keys [b, n, dim]`` of windows ``first [b] + 0 .. n - 1`` rotated at their first positions."""
    cos, sin = spec.rope.tables((first[:, None] + jnp.arange(keys.shape[1])[None, :]) * spec.rate)
    return rope_tail(keys[:, :, None, :], cos, sin)[:, :, 0, :]


def compressed_keys(p: Params, x: jax.Array, spec: Spec) -> jax.Array:
    """The rotated keys of every full window of ``x [b, s, hidden]`` from slot 0: ``[b, s // rate, dim]``."""
    b, s, _ = x.shape
    n = s // spec.rate
    if n == 0:
        return jnp.zeros((b, 0, spec.dim), x.dtype)
    kv, gate = _project(p, x[:, : n * spec.rate])
    return _rotate(_pool(p, kv, gate, spec), jnp.zeros((b,), jnp.int32), spec)


def init_state(spec: Spec, batch: int, slots: int, dtype: DTypeLike, prefix: str = "") -> GroupCache:
    """An empty compressor state for ``slots`` tokens a row: no window, no token pending; the
    predecessor of window 0 (the pending slots before the first token) gets weight 0 (gate ``-inf``)."""
    pending = (batch, spec.series * spec.rate, spec.series * spec.dim)
    return {f"{prefix}windows": jnp.zeros((batch, slots // spec.rate, spec.dim), dtype),
            f"{prefix}pool_kv": jnp.zeros(pending, dtype),
            f"{prefix}pool_gate": jnp.full(pending, -jnp.inf, jnp.float32)}


def _per_row_set(target: jax.Array, index: jax.Array, values: jax.Array) -> jax.Array:
    """``target [b, n, ...]`` with ``values [b, m, ...]`` written at ``index [b, m]`` (indices out of
    range dropped)."""
    out: jax.Array = jax.vmap(lambda t, i, v: t.at[i].set(v.astype(t.dtype), mode="drop"))(target, index, values)
    return out


def _per_row_slice(a: jax.Array, start: jax.Array, size: int) -> jax.Array:
    """``a [b, n, ...]`` sliced per row: ``size`` entries from ``start [b]``."""
    out: jax.Array = jax.vmap(lambda row, i: jax.lax.dynamic_slice_in_dim(row, i, size, axis=0))(a, start)
    return out


def cached_keys(
    p: Params, x: jax.Array, real: jax.Array, before: jax.Array, state: GroupCache, spec: Spec, prefix: str = ""
) -> tuple[jax.Array, GroupCache]:
    """The compressor's windows after this call's tokens ``x [b, s, hidden]`` (``real [b, s]``: which
    are tokens, ``before [b]``: the row's tokens already cached) and its updated ``state``.

    The pending projections (tokens ``base .. base + series * rate - 1`` of the row, ``base`` a window
    boundary) and this call's real tokens after them form one aligned run; every window of the run
    that this call completes is pooled as without a cache and written once into ``windows``; the
    run's tail from the new boundary becomes the pending state."""
    rate, pending = spec.rate, spec.series * spec.rate
    b, s, _ = x.shape
    count = before + real.sum(axis=-1, dtype=jnp.int32)
    base = (before // rate - (spec.series - 1)) * rate  # the row's token at the run's slot 0
    length = pending + rate * (-(-s // rate) + 1)  # room for the run and the next pending state
    kv, gate = _project(p, x)
    at = jnp.where(real, before[:, None] - base[:, None] + jnp.cumsum(real, axis=-1) - 1, length)
    run_kv = _per_row_set(jnp.pad(state[f"{prefix}pool_kv"], ((0, 0), (0, length - pending), (0, 0))), at, kv)
    run_gate = _per_row_set(jnp.pad(state[f"{prefix}pool_gate"], ((0, 0), (0, length - pending), (0, 0))), at, gate)
    unseen = (jnp.arange(length)[None, :] >= (count - base)[:, None])[..., None]  # no token there yet
    run_kv, run_gate = jnp.where(unseen, 0, run_kv), jnp.where(unseen, 0.0, run_gate)
    first = base // rate
    keys = _rotate(_pool(p, run_kv, run_gate, spec), first, spec)
    v = jnp.arange(length // rate)[None, :]
    done = (v >= spec.series - 1) & (base[:, None] + (v + 1) * rate <= count[:, None])  # newly completed
    windows = state[f"{prefix}windows"]
    windows = _per_row_set(windows, jnp.where(done, first[:, None] + v, windows.shape[1]), keys)
    start = (count // rate - (spec.series - 1)) * rate - base
    return windows, {f"{prefix}windows": windows, f"{prefix}pool_kv": _per_row_slice(run_kv, start, pending),
                     f"{prefix}pool_gate": _per_row_slice(run_gate, start, pending)}
