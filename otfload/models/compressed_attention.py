"""DeepSeek-V4's attention: one shared key-value head (keys equal values) over a sliding window, plus,
on compressed layers, keys that each summarise a window of tokens, as transformers 5.24 computes them.

* Queries: ``q_a`` → RMSNorm ``q_a_norm`` (the query latent) → ``q_b`` per head → RMSNorm without a
  weight per head. Key-value: ``kv`` → RMSNorm ``kv_norm``. RoPE rotates the *last*
  ``qk_rope_head_dim`` dims of each head in interleaved pairs; since values carry that rotation too,
  the output's rotated dims are rotated back (``-sin``) at the query's position.
* A per-head sink (a virtual key whose logit is ``sinks[h]``) joins the softmax, as GPT-OSS's.
* Grouped output projection: the heads split into ``o_groups`` groups, each projected by its block of
  ``o_a`` (``[groups * o_lora_rank, heads * head_dim / groups]``) to ``o_lora_rank``, then ``o_b``.
* Heavily compressed layers (HCA, rate ``m'``): each full window of ``m'`` tokens becomes one key,
  ``kv_norm(sum_j softmax_j(gate_j + ape_j) * kv_j)``, rotated at the window's first position (the
  ``compress`` RoPE); a query at position ``t`` sees the windows ``w < (t + 1) // m'``.
* Compressed sparse layers (CSA, rate ``m``): two series per token (``kv``/``gate`` of ``2 head_dim``),
  each key pooling the window's second series with the previous window's first (width ``2m``,
  stride ``m``); the lightning indexer (its own compressor at ``index_head_dim``, queries ``q_b``
  from the query latent, ``weights_proj``) scores ``sum_h w_h relu(q_h . k)`` and each query sees
  the ``index_topk`` visible windows it scores highest (all of them while there are no more).

Without a cache only this call's tokens are compressed (the partial last window is dropped), as
transformers' forward does. The logits are ``[b, heads, s, s + windows]``: fine for the tiny and
medium sequences this is checked on; the sliding part is not sliced to the window.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.attention import MASKED
from otfload.models.layers import Dense, Norm, ParamOptions, Params, dense, make_param, rms_norm_scaled_f32

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


class Rotary(NamedTuple):
    """One RoPE: inverse frequencies (one per rotated pair) and the factor cos/sin are scaled by."""

    inv_freq: np.ndarray
    scale: float

    def tables(self, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
        """``(cos, sin)`` at ``positions [b, n]``: ``[b, n, pairs]`` each."""
        freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(self.inv_freq)
        return jnp.cos(freqs) * self.scale, jnp.sin(freqs) * self.scale


class CompressedAttentionShape(Protocol):
    """The config fields the V4 attention reads."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def head_dim(self) -> int: ...
    @property
    def q_lora_rank(self) -> int: ...
    @property
    def qk_rope_head_dim(self) -> int: ...
    @property
    def o_groups(self) -> int: ...
    @property
    def o_lora_rank(self) -> int: ...
    @property
    def sliding_window(self) -> int: ...
    @property
    def index_n_heads(self) -> int: ...
    @property
    def index_head_dim(self) -> int: ...
    @property
    def index_topk(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def compress_rate_csa(self) -> int: ...
    @property
    def compress_rate_hca(self) -> int: ...


def compress_rate(cfg: CompressedAttentionShape, kind: str) -> int:
    return cfg.compress_rate_csa if kind == CSA else cfg.compress_rate_hca


class Compressor(nnx.Module):
    """A window compressor's ``kv``, ``gate`` (``[series * dim, hidden]``), ``ape`` (``[rate, series *
    dim]``, float32) and ``norm`` (``[dim]``); ``series`` is 2 for the overlapping CSA windows."""

    def __init__(
        self, hidden: int, dim: int, rate: int, series: int, *, dtype: DTypeLike, rngs: nnx.Rngs | None,
        stack: int | None = None,
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.kv = Dense((series * dim, hidden), ("head_dim", "embed"), **kw)
        self.gate = Dense((series * dim, hidden), ("head_dim", "embed"), **kw)
        self.ape = make_param(rngs, (rate, series * dim), (None, "head_dim"), jnp.float32, stack)
        self.norm = Norm(dim, dtype=jnp.float32, rngs=rngs, stack=stack)


class LightningIndexer(nnx.Module):
    """The CSA indexer: its compressor, query projection ``q_b`` and ``weights_proj``."""

    def __init__(
        self, cfg: CompressedAttentionShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        self.compressor = Compressor(cfg.hidden_size, dim, cfg.compress_rate_csa, 2, **kw)
        self.q_b = Dense((heads, dim, cfg.q_lora_rank), ("heads", "head_dim", "embed"), **kw)
        self.weights_proj = Dense((heads, cfg.hidden_size), ("heads", "embed"), **kw)


class CompressedAttention(nnx.Module):
    """One V4 attention of layer kind ``kind`` (:data:`SLIDING`, :data:`CSA` or :data:`HCA`).

    The query latent and the grouped heads' dims (inputs of ``q_b``, the indexer's ``q_b`` and ``o_a``)
    are sharded like the model width (``"embed"``: fsdp), so that without a ``tp`` axis none of these
    kernels (64 MiB a layer at V4-Flash's size) is whole on every device."""

    def __init__(
        self, cfg: CompressedAttentionShape, kind: str, *, dtype: DTypeLike, rngs: nnx.Rngs | None,
        stack: int | None = None,
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        h, n, d, r = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank
        g, rank = cfg.o_groups, cfg.o_lora_rank
        self.q_a = Dense((r, h), ("q_lora", "embed"), **kw)
        self.q_a_norm = Norm(r, dtype=jnp.float32, rngs=rngs, stack=stack)
        self.q_b = Dense((n, d, r), ("heads", "head_dim", "embed"), **kw)
        self.kv = Dense((d, h), ("head_dim", "embed"), **kw)
        self.kv_norm = Norm(d, dtype=jnp.float32, rngs=rngs, stack=stack)
        self.o_a = Dense((g, rank, n // g * d), (None, "mlp", "embed"), **kw)
        self.o_b = Dense((h, g * rank), ("embed", "mlp"), **kw)
        self.sinks = make_param(rngs, (n,), ("heads",), jnp.float32, stack)
        if kind != SLIDING:
            self.compressor = Compressor(h, d, compress_rate(cfg, kind), 2 if kind == CSA else 1, **kw)
        if kind == CSA:
            self.indexer = LightningIndexer(cfg, **kw)


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


def _windows(p: Params, x: jax.Array, rate: int, dim: int, overlap: bool, eps: float) -> jax.Array:
    """The pooled, normalised (not yet rotated) keys of every full window of ``x``: ``[b, windows, dim]``."""
    b, s, _ = x.shape
    n = s // rate
    if n == 0:
        return jnp.zeros((b, 0, dim), x.dtype)
    kv = dense(p["kv"], x[:, : n * rate], "bsh,oh->bso").reshape(b, n, rate, -1)
    gate = dense(p["gate"], x[:, : n * rate], "bsh,oh->bso").reshape(b, n, rate, -1)
    gate = gate.astype(jnp.float32) + p["ape"].astype(jnp.float32)
    if overlap:  # window w pools window w - 1's first series with its own second one
        first_kv = jnp.pad(kv[:, :-1, :, :dim], ((0, 0), (1, 0), (0, 0), (0, 0)))
        first_gate = jnp.pad(gate[:, :-1, :, :dim], ((0, 0), (1, 0), (0, 0), (0, 0)), constant_values=-jnp.inf)
        kv = jnp.concatenate([first_kv, kv[..., dim:]], axis=2)
        gate = jnp.concatenate([first_gate, gate[..., dim:]], axis=2)
    weights = jax.nn.softmax(gate, axis=2).astype(kv.dtype)
    pooled = (kv * weights).sum(axis=2)
    return rms_norm_scaled_f32(pooled, p["norm"]["scale"], eps)


def compressed_keys(
    p: Params, x: jax.Array, rate: int, dim: int, overlap: bool, rope: Rotary, eps: float
) -> jax.Array:
    """:func:`_windows` rotated at each window's first position ``w * rate``: ``[b, windows, dim]``."""
    keys = _windows(p, x, rate, dim, overlap, eps)
    n = keys.shape[1]
    cos, sin = rope.tables(jnp.arange(n)[None, :] * rate)
    return rope_tail(keys[:, :, None, :], cos, sin)[:, :, 0, :]


def _ready(positions: jax.Array, windows: int, rate: int) -> jax.Array:
    """``[b, s, windows]``: which windows each query has seen whole (``w < (t + 1) // rate``)."""
    return jnp.arange(windows)[None, None, :] < ((positions + 1) // rate)[..., None]


def _selected(
    p: Params, x: jax.Array, q_latent: jax.Array, positions: jax.Array, rope: Rotary,
    cfg: CompressedAttentionShape,
) -> jax.Array:
    """``[b, s, windows]``: the CSA windows each query attends to (the indexer's top ``index_topk``
    of the ones it has seen)."""
    rate, dim, heads = cfg.compress_rate_csa, cfg.index_head_dim, cfg.index_n_heads
    keys = compressed_keys(p["compressor"], x, rate, dim, True, rope, cfg.rms_norm_eps)
    n = keys.shape[1]
    ready = _ready(positions, n, rate)
    if n <= cfg.index_topk:
        return ready
    q = rope_tail(dense(p["q_b"], q_latent, "bsr,ndr->bsnd"), *rope.tables(positions)).astype(jnp.float32)
    scores = jax.nn.relu(jnp.einsum("bsnd,btd->bsnt", q, keys.astype(jnp.float32))) * dim**-0.5
    weights = jnp.einsum("bsh,nh->bsn", x.astype(jnp.float32), p["weights_proj"]["kernel"].astype(jnp.float32))
    scores = jnp.einsum("bsnt,bsn->bst", scores, weights * heads**-0.5)
    _, top = jax.lax.top_k(jnp.where(ready, scores, -jnp.inf), cfg.index_topk)
    chosen = jax.nn.one_hot(top, n, dtype=jnp.bool_).any(axis=-2)
    return chosen & ready


def compressed_attention_forward(
    a: Params, x: jax.Array, kind: str, cfg: CompressedAttentionShape, ropes: Mapping[str, Rotary],
    positions: jax.Array, kv_mask: jax.Array | None,
) -> jax.Array:
    """One V4 attention of ``x [b, s, hidden]`` (the call's tokens at slots ``0 .. s - 1``, ``positions
    [b, s]``, ``kv_mask [b, s]`` real tokens or None); ``ropes``: the ``main`` and ``compress`` RoPEs."""
    b, s, _ = x.shape
    eps = cfg.rms_norm_eps
    cos, sin = ropes["main" if kind == SLIDING else "compress"].tables(positions)
    q_latent = rms_norm_scaled_f32(dense(a["q_a"], x, "bsh,rh->bsr"), a["q_a_norm"]["scale"], eps)
    q = dense(a["q_b"], q_latent, "bsr,ndr->bsnd")
    q32 = q.astype(jnp.float32)
    q = (q32 * jax.lax.rsqrt(jnp.mean(q32 * q32, axis=-1, keepdims=True) + eps)).astype(q.dtype)
    q = rope_tail(q, cos, sin)
    kv = rms_norm_scaled_f32(dense(a["kv"], x, "bsh,dh->bsd"), a["kv_norm"]["scale"], eps)
    kv = rope_tail(kv[:, :, None, :], cos, sin)[:, :, 0, :]

    slots = jnp.arange(s)
    visible = (slots[None, :] <= slots[:, None]) & (slots[:, None] - slots[None, :] < cfg.sliding_window)
    visible = jnp.broadcast_to(visible[None], (b, s, s))
    if kv_mask is not None:
        visible = visible & kv_mask[:, None, :]
    keys = kv
    if kind != SLIDING:
        rate = compress_rate(cfg, kind)
        extra = compressed_keys(a["compressor"], x, rate, cfg.head_dim, kind == CSA, ropes["compress"], eps)
        if kind == CSA:
            seen = _selected(a["indexer"], x, q_latent, positions, ropes["compress"], cfg)
        else:
            seen = _ready(positions, extra.shape[1], rate)
        keys = jnp.concatenate([kv, extra.astype(kv.dtype)], axis=1)
        visible = jnp.concatenate([visible, seen], axis=-1)

    logits = jnp.einsum("bsnd,btd->bnst", q, keys, preferred_element_type=jnp.float32) * cfg.head_dim**-0.5
    logits = jnp.where(visible[:, None], logits, MASKED)
    sink = a["sinks"].astype(jnp.float32)[None, :, None, None]
    top = jnp.maximum(logits.max(axis=-1, keepdims=True), sink)
    weights = jnp.exp(logits - top)
    probs = (weights / (weights.sum(axis=-1, keepdims=True) + jnp.exp(sink - top))).astype(keys.dtype)
    out = jnp.einsum("bnst,btd->bsnd", probs, keys)
    out = rope_tail(out, cos, -sin)

    g = cfg.o_groups
    grouped = out.reshape(b, s, g, -1)
    mid = jnp.einsum("bsgi,gri->bsgr", grouped, a["o_a"]["kernel"]).reshape(b, s, -1)
    return dense(a["o_b"], mid, "bsr,hr->bsh")
