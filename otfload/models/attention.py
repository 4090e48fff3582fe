"""Attention for the bundled models: grouped KV heads without repeats, float32 softmax, padding
masks, positions and a KV cache; memory linear in the sequence length.

Masks follow transformers: a query at key slot ``i`` sees slot ``j`` when ``j <= i`` (causal, by
slot index), ``i - j < window`` (sliding layers), ``i`` and ``j`` fall in the same ``chunk`` of slots counted
from the row's first real token (chunked layers: Llama 4) and slot ``j`` holds a real token (the
padding mask). Positions only feed RoPE. Slots are the sequence indices, or the cache slots when decoding.

Packed rows (several sequences in one row, without a cache) add ``segments`` and ``prefixes``: a
query of segment ``t`` whose prefix is segment ``p`` sees keys of segments ``t`` and ``p`` only.
A sequence alone is a segment that is its own prefix; sequences that share a prefix (branches)
are each a segment whose prefix is the shared one's, so each attends to the prefix and to its own
earlier tokens, as if it were alone after the prefix (its positions given to continue from the
prefix's end). The window stays a distance in slots: a caller packing rows keeps each prefix and
its branches within a sliding layer's window, where no visible key is outside it either way.

Implementations (``impl``):

* ``"chunked"``: queries in chunks of :data:`Q_CHUNK`; each chunk's float32 logits against all keys
  (``[b, heads, chunk, keys]``), so memory grows linearly with the sequence. Sliding-window layers
  with a static window read only the keys a chunk can see (compute linear in the sequence too).
  Handles soft-capping and sinks (GPT-OSS's per-head virtual key). The default.
* ``"dpa"``: ``jax.nn.dot_product_attention`` where it fits (no soft-cap, no sinks, equal key and
  value head dims; else ``"chunked"``). Its default XLA implementation, the one jax picks on every
  backend unless told ``implementation="cudnn"``, materialises the ``[b, h, s, slots]`` logits, so
  it is opt-in (``model.attention_impl = "dpa"``); wiring cuDNN's fused kernel awaits a GPU to
  validate it on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

CHUNKED, DPA = "chunked", "dpa"
IMPLS = (CHUNKED, DPA)
# Queries per chunk: one chunk's f32 logits are [batch, heads, Q_CHUNK, keys] (e.g. 16 MiB per head
# and batch row at 8192 keys), so peak memory is linear in the keys; large enough that the
# [chunk, head_dim] x [head_dim, keys] matmuls stay efficient.
Q_CHUNK = 512
# Logit of masked slots: the float32 minimum, not -inf, so a row with no visible slot (a padding
# query) gets finite, ignored values instead of NaNs that 0 * NaN would spread.
MASKED = float(np.finfo(np.float32).min)
# Logical axes of the cache leaves, for sharding on the model's mesh (see otfload.generate).
# A layer's sliding window: static (an int or a numpy integer; 0 or less: none) or a traced scalar.
Window = int | np.integer[Any] | jax.Array
CACHE_AXES = {"k": ("layers", "batch", None, "kv_heads", "head_dim"),
              "v": ("layers", "batch", None, "kv_heads", "head_dim"),
              "mask": ("batch", None), "index": (),
              # recurrent layers (otfload.models.gated_delta, .mamba2): the conv's last inputs and the state
              "conv": ("layers", "batch", "mlp", None), "state": ("layers", "batch", "heads", None, None),
              # DeepSeek-V4's compressors (otfload.models.compressor): windows, pending projections
              **{f"{p}{k}": ("layers", "batch", None, "head_dim") for p in ("", "index_")
                 for k in ("windows", "pool_kv", "pool_gate")}}


@dataclass(frozen=True)
class Context:
    """What every layer of one forward call shares besides its parameters.

    ``positions [b, s]`` feed RoPE; ``q_index [s]`` is each query's key slot; ``kv_mask [b, slots]``
    marks slots holding real tokens (None: all do); ``cache_index`` is the first cache slot this call
    writes (None without a cache); ``attention_impl``/``moe_impl`` pick implementations (None: the
    backend's default); ``segments [b, s]`` and ``prefixes [b, s]`` each slot's segment and its
    segment's prefix in a packed row (None: one sequence per row; see the module docstring).
    """

    positions: jax.Array
    q_index: jax.Array
    kv_mask: jax.Array | None
    cache_index: jax.Array | None = None
    attention_impl: str | None = None
    moe_impl: str | None = None
    segments: jax.Array | None = None
    prefixes: jax.Array | None = None


def make_context(
    input_ids: jax.Array,
    attention_mask: jax.Array | np.ndarray | None,
    positions: jax.Array | np.ndarray | None,
    cache: Mapping[str, Any] | None,
    attention_impl: str | None = None,
    moe_impl: str | None = None,
    segments: tuple[jax.Array | np.ndarray, jax.Array | np.ndarray] | None = None,
) -> Context:
    """The :class:`Context` of ``model(input_ids, attention_mask, positions, cache)``.

    ``positions=None`` gives each real token its index among the real tokens of its row (after the
    ones in ``cache``), as transformers' ``generate`` does; padding slots get 0. ``segments``
    (packed rows, no cache): ``(segment, prefix)`` of each slot, ``[b, s]`` each."""
    b, s = input_ids.shape
    if segments is not None and (cache is not None or any(np.shape(a) != (b, s) for a in segments)):
        raise ValueError(f"segments of shapes {[np.shape(a) for a in segments]} with"
                         f"{'' if cache is None else ' a'} cache; expected {(b, s)} like input_ids and no cache")
    mask = None if attention_mask is None else jnp.asarray(attention_mask).astype(bool)
    if mask is not None and mask.shape != (b, s):
        raise ValueError(f"attention_mask has shape {mask.shape}; expected {(b, s)} like input_ids")
    if positions is None:
        ones = jnp.ones((b, s), bool) if mask is None else mask
        before = 0 if cache is None else cache["mask"].sum(-1, keepdims=True)
        positions = jnp.where(ones, before + jnp.cumsum(ones, axis=-1) - 1, 0)
    positions = jnp.broadcast_to(jnp.asarray(positions, jnp.int32), (b, s))
    if cache is None:
        seg, pre = (None, None) if segments is None else (jnp.asarray(a, jnp.int32) for a in segments)
        return Context(positions, jnp.arange(s), mask, None, attention_impl, moe_impl, seg, pre)
    index = jnp.asarray(cache["index"], jnp.int32)
    new = jnp.ones((b, s), bool) if mask is None else mask
    kv_mask = jax.lax.dynamic_update_slice(cache["mask"], new, (0, index))
    return Context(positions, index + jnp.arange(s), kv_mask, index, attention_impl, moe_impl)


def token_mask(ctx: Context, s: int) -> jax.Array | None:
    """``[b, s]``: which of this call's ``s`` tokens are real (None: all are), for the recurrent mixers."""
    if ctx.kv_mask is None:
        return None
    if ctx.cache_index is None:
        return ctx.kv_mask
    return jax.lax.dynamic_slice_in_dim(ctx.kv_mask, ctx.cache_index, s, axis=1)


def write_cache(layer_cache: Mapping[str, jax.Array], name: str, value: jax.Array, ctx: Context) -> jax.Array:
    """``layer_cache[name] [b, slots, ...]`` with ``value [b, s, ...]`` written at the call's slots."""
    assert ctx.cache_index is not None, "a context made without a cache writes none"
    start = (0, ctx.cache_index) + (0,) * (value.ndim - 2)
    return jax.lax.dynamic_update_slice(layer_cache[name], value.astype(layer_cache[name].dtype), start)


def self_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, ctx: Context, layer_cache: Mapping[str, jax.Array] | None, **kw: Any
) -> tuple[jax.Array, dict[str, jax.Array] | None]:
    """:func:`attention` of this call's ``q, k, v`` (``[b, s, heads, dim]``), through the cache
    when there is one: returns ``(out, updated layer cache or None)``."""
    if layer_cache is None:
        return attention(q, k, v, ctx, **kw), None
    new = {"k": write_cache(layer_cache, "k", k, ctx), "v": write_cache(layer_cache, "v", v, ctx)}
    return attention(q, new["k"], new["v"], ctx, **kw), new


def attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ctx: Context,
    *,
    scale: float,
    window: Window | None = None,
    softcap: float | None = None,
    sinks: jax.Array | None = None,
    chunk: Window | None = None,
    q_chunk: int = Q_CHUNK,
) -> jax.Array:
    """Grouped-query attention ``q [b, s, heads, dk]`` over ``k [b, slots, kv_heads, dk]`` and
    ``v [b, slots, kv_heads, dv]`` → ``[b, s, heads, dv]``, masked as the module docstring says.
    ``window`` may be a traced scalar (a scanned per-layer value; 0 or less: no window); ``q_chunk``
    is the number of queries attended at once (``"chunked"``); ``chunk`` (static or traced, 0 or less:
    none) the attention chunk of chunked layers."""
    impl = ctx.attention_impl or CHUNKED
    if impl not in IMPLS:
        raise ValueError(f"unknown attention implementation {impl!r}; expected one of {IMPLS}")
    if isinstance(window, (int, np.integer)):  # a static window; 0 or less: none
        window = int(window) if window > 0 else None
    fits_dpa = softcap is None and sinks is None and chunk is None and k.shape[-1] == v.shape[-1]
    if impl == DPA and fits_dpa:
        return _dpa(q, k, v, ctx, scale, window)
    b, s, heads, dk = q.shape
    kv_heads = k.shape[2]
    groups = heads // kv_heads
    # [b, kv, group, s, dk]: each KV head's queries form one matrix of group * chunk rows.
    qg = q.reshape(b, s, kv_heads, groups, dk).transpose(0, 2, 3, 1, 4)
    sinks = None if sinks is None else sinks.reshape(kv_heads, groups)
    static_window = window if isinstance(window, int) else None

    chunks_of = None if chunk is None else _chunk_ids(ctx.kv_mask, b, chunk)

    def attend(qc: jax.Array, qi: jax.Array) -> jax.Array:
        return _attend(qc, qi, k, v, ctx.kv_mask, _segments(ctx), scale, window, static_window, softcap, sinks,
                       chunks_of)

    if s <= q_chunk:
        out = attend(qg, ctx.q_index)
    else:
        chunks = -(-s // q_chunk)
        pad = chunks * q_chunk - s
        qc = jnp.pad(qg, ((0, 0), (0, 0), (0, 0), (0, pad), (0, 0)))
        qc = jnp.moveaxis(qc.reshape(b, kv_heads, groups, chunks, q_chunk, dk), 3, 0)
        qi = jnp.pad(ctx.q_index, (0, pad), mode="edge").reshape(chunks, q_chunk)
        out = jax.lax.map(lambda c: attend(*c), (qc, qi))
        out = jnp.moveaxis(out, 0, 3).reshape(b, kv_heads, groups, chunks * q_chunk, -1)[:, :, :, :s]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, heads, v.shape[-1])


def _attend(
    qg: jax.Array,
    q_index: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: jax.Array | None,
    segments: tuple[jax.Array, jax.Array] | None,
    scale: float,
    window: int | jax.Array | None,
    static_window: int | None,
    softcap: float | None,
    sinks: jax.Array | None,
    chunks_of: ChunkIds | None = None,
) -> jax.Array:
    """One query chunk ``qg [b, kv, g, c, dk]`` (slots ``q_index [c]``) against the keys
    ``[b, slots, kv, d]`` → ``[b, kv, g, c, dv]``; ``segments``: ``(segment, prefix)`` of each slot of a
    packed row, ``[b, slots]`` each."""
    b, kv_heads, groups, c, dk = qg.shape
    k_index = jnp.arange(k.shape[1])
    k_segments = None if segments is None else segments[0]
    if static_window is not None and static_window + c - 1 < k.shape[1]:
        # Only slots [first query - window + 1, last query] are visible: slice them (start clamped).
        span = static_window + c - 1
        start = jnp.clip(q_index[0] - static_window + 1, 0, k.shape[1] - span)
        k, v = (jax.lax.dynamic_slice_in_dim(t, start, span, axis=1) for t in (k, v))
        mask = None if mask is None else jax.lax.dynamic_slice_in_dim(mask, start, span, axis=1)
        k_segments = None if k_segments is None else jax.lax.dynamic_slice_in_dim(k_segments, start, span, axis=1)
        k_index = start + jnp.arange(span)
    rows = qg.reshape(b, kv_heads, groups * c, dk)
    logits = jnp.einsum("bkmd,bskd->bkms", rows, k, preferred_element_type=jnp.float32)
    logits = logits.reshape(b, kv_heads, groups, c, -1) * scale
    if softcap:
        logits = jnp.tanh(logits / softcap) * softcap
    visible = k_index[None, :] <= q_index[:, None]
    if window is not None:
        visible &= (q_index[:, None] - k_index[None, :] < window) | (jnp.asarray(window) <= 0)
    visible = visible[None] if mask is None else visible[None] & mask[:, None, :]
    if segments is not None and k_segments is not None:
        visible &= _same_sequence(segments, q_index, k_segments)
    if chunks_of is not None:
        visible &= chunks_of(q_index)[:, :, None] == chunks_of(k_index)[:, None, :]
    logits = jnp.where(visible[:, None, None], logits, MASKED)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1)
    else:  # a softmax over the slots plus one virtual slot per head whose logit is the sink
        sink = sinks.astype(jnp.float32)[None, :, :, None, None]
        top = jnp.maximum(logits.max(axis=-1, keepdims=True), sink)
        weights = jnp.exp(logits - top)
        probs = weights / (weights.sum(axis=-1, keepdims=True) + jnp.exp(sink - top))
    probs = probs.astype(v.dtype)
    out = jnp.einsum("bkms,bskd->bkmd", probs.reshape(b, kv_heads, groups * c, -1), v)
    return out.reshape(b, kv_heads, groups, c, v.shape[-1])


def _dpa(
    q: jax.Array, k: jax.Array, v: jax.Array, ctx: Context, scale: float, window: int | jax.Array | None
) -> jax.Array:
    """``jax.nn.dot_product_attention`` with the same mask (a boolean ``[b, 1, s, slots]``)."""
    k_index = jnp.arange(k.shape[1])
    visible = k_index[None, :] <= ctx.q_index[:, None]
    if window is not None:
        visible &= (ctx.q_index[:, None] - k_index[None, :] < window) | (jnp.asarray(window) <= 0)
    visible = visible[None] if ctx.kv_mask is None else visible[None] & ctx.kv_mask[:, None, :]
    segments = _segments(ctx)
    if segments is not None:
        visible &= _same_sequence(segments, ctx.q_index, segments[0])
    return jax.nn.dot_product_attention(q, k, v, mask=visible[:, None], scale=scale)


ChunkIds = Callable[[jax.Array], jax.Array]


def _chunk_ids(mask: jax.Array | None, batch: int, chunk: Window) -> ChunkIds:
    """``ids(slots [n]) -> [b, n]``: each slot's attention chunk, counted from its row's first real
    token (transformers' chunked mask); every slot is in chunk 0 when ``chunk`` is 0 or less."""
    first = jnp.zeros((batch, 1), jnp.int32) if mask is None else jnp.argmax(mask, axis=-1)[:, None]
    size = jnp.asarray(chunk, jnp.int32)

    def ids(slots: jax.Array) -> jax.Array:
        return jnp.where(size > 0, (slots[None, :] - first) // jnp.maximum(size, 1), 0)

    return ids


def _segments(ctx: Context) -> tuple[jax.Array, jax.Array] | None:
    return None if ctx.segments is None or ctx.prefixes is None else (ctx.segments, ctx.prefixes)


def _same_sequence(segments: tuple[jax.Array, jax.Array], q_index: jax.Array, k_segments: jax.Array) -> jax.Array:
    """``[b, queries, keys]``: whether each key's segment is the query's own or its prefix
    (``segments`` of every slot, the queries at slots ``q_index``, ``k_segments`` the keys')."""
    q_own, q_prefix = (jnp.take(a, q_index, axis=1)[:, :, None] for a in segments)
    keys = k_segments[:, None, :]
    return (keys == q_own) | (keys == q_prefix)
