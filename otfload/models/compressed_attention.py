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
transformers' forward does. With one (``init_cache``: :mod:`otfload.models.compressor`'s state and the
sliding keys ``k [b, slots, 1, head_dim]`` per layer) each call writes its keys at its slots and the
compressors emit the windows its tokens complete, so a decoding step costs one token's projections
plus its attention. Queries run in chunks of :data:`Q_CHUNK`, each reading only the
``sliding_window + Q_CHUNK - 1`` sliding slots it can see plus every window (masked to the ones it
attends to), so memory is linear in the sequence; the windows' and the indexer's scores still cost
every window per query (``s / rate`` of them), as the indexer's do anywhere.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.attention import MASKED, Context, token_mask, write_cache
from otfload.models.base import GroupCache
from otfload.models.compressor import Rotary, Spec, cached_keys, compressed_keys, rope_tail
from otfload.models.layers import Dense, Norm, ParamOptions, Params, dense, make_param, rms_norm_scaled_f32

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# Queries attended at once: a chunk's logits are [b, heads, Q_CHUNK, sliding_window + Q_CHUNK - 1 +
# windows] float32 and a CSA chunk's indexer scores [b, Q_CHUNK, index_heads, windows].
Q_CHUNK = 64


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


def _ready(positions: jax.Array, windows: int, rate: int) -> jax.Array:
    """``[b, s, windows]``: which windows each query has seen whole (``w < (t + 1) // rate``)."""
    return jnp.arange(windows)[None, None, :] < ((positions + 1) // rate)[..., None]


class _Indexer(NamedTuple):
    """The CSA indexer's side of a call: its window keys ``[b, windows, dim]`` (float32), rotated
    queries ``[b, s, heads, dim]`` (float32) and head weights ``[b, s, heads]`` (scales applied)."""

    keys: jax.Array
    q: jax.Array
    weights: jax.Array


def _indexer(
    p: Params, keys: jax.Array, x: jax.Array, q_latent: jax.Array, positions: jax.Array, rope: Rotary,
    cfg: CompressedAttentionShape,
) -> _Indexer:
    """The indexer's side of a call over its window ``keys [b, windows, index_head_dim]``."""
    dim, heads = cfg.index_head_dim, cfg.index_n_heads
    q = rope_tail(dense(p["q_b"], q_latent, "bsr,ndr->bsnd"), *rope.tables(positions)).astype(jnp.float32)
    weights = jnp.einsum("bsh,nh->bsn", x.astype(jnp.float32), p["weights_proj"]["kernel"].astype(jnp.float32))
    return _Indexer(keys.astype(jnp.float32), q * dim**-0.5, weights * heads**-0.5)


def _selected(index: _Indexer, ready: jax.Array, top_k: int) -> jax.Array:
    """``[b, c, windows]``: the windows a chunk of queries attends to, the indexer's ``top_k`` of those
    they have seen whole (``ready``; all of them while there are no more), scored
    ``sum_h w_h relu(q_h . k)``."""
    windows = ready.shape[-1]
    if windows <= top_k:
        return ready
    scores = jax.nn.relu(jnp.einsum("bcnd,btd->bcnt", index.q, index.keys))
    scores = jnp.einsum("bcnt,bcn->bct", scores, index.weights)
    _, top = jax.lax.top_k(jnp.where(ready, scores, -jnp.inf), top_k)
    return jax.nn.one_hot(top, windows, dtype=jnp.bool_).any(axis=-2) & ready


class _Chunk(NamedTuple):
    """One chunk of queries: ``q [b, c, heads, d]``, their slots ``[c]`` and positions ``[b, c]``, and
    the indexer's queries and weights for them (None off CSA layers)."""

    q: jax.Array
    slots: jax.Array
    positions: jax.Array
    index_q: jax.Array | None
    index_weights: jax.Array | None


def _attend(
    chunk: _Chunk, kv: jax.Array, kv_mask: jax.Array | None, windows: jax.Array | None, index: _Indexer | None,
    sinks: jax.Array, kind: str, cfg: CompressedAttentionShape,
) -> jax.Array:
    """A chunk's attention ``[b, c, heads, d]`` over the sliding keys it can see (only those slots
    are read) and the compressed ``windows`` ``[b, windows, d]`` it attends to."""
    b, s = kv.shape[:2]
    c, window = chunk.slots.shape[0], cfg.sliding_window
    k_slots = jnp.arange(s)
    if window + c - 1 < s:  # only slots [first query - window + 1, last query] are visible
        span = window + c - 1
        start = jnp.clip(chunk.slots[0] - window + 1, 0, s - span)
        kv = jax.lax.dynamic_slice_in_dim(kv, start, span, axis=1)
        kv_mask = None if kv_mask is None else jax.lax.dynamic_slice_in_dim(kv_mask, start, span, axis=1)
        k_slots = start + jnp.arange(span)
    q_slots = chunk.slots[:, None]
    visible = jnp.broadcast_to(((k_slots <= q_slots) & (q_slots - k_slots < window))[None], (b, c, kv.shape[1]))
    if kv_mask is not None:
        visible = visible & kv_mask[:, None, :]
    keys = kv
    if windows is not None:
        ready = _ready(chunk.positions, windows.shape[1], compress_rate(cfg, kind))
        if index is not None:
            assert chunk.index_q is not None and chunk.index_weights is not None
            ready = _selected(index._replace(q=chunk.index_q, weights=chunk.index_weights), ready, cfg.index_topk)
        keys = jnp.concatenate([kv, windows.astype(kv.dtype)], axis=1)
        visible = jnp.concatenate([visible, ready], axis=-1)
    logits = jnp.einsum("bcnd,btd->bnct", chunk.q, keys, preferred_element_type=jnp.float32) * cfg.head_dim**-0.5
    logits = jnp.where(visible[:, None], logits, MASKED)
    sink = sinks.astype(jnp.float32)[None, :, None, None]
    top = jnp.maximum(logits.max(axis=-1, keepdims=True), sink)
    weights = jnp.exp(logits - top)
    probs = (weights / (weights.sum(axis=-1, keepdims=True) + jnp.exp(sink - top))).astype(keys.dtype)
    return jnp.einsum("bnct,btd->bcnd", probs, keys)


def _in_chunks(attend: Callable[[_Chunk], jax.Array], chunk: _Chunk, size: int) -> jax.Array:
    """``attend`` over ``chunk`` (the whole call) cut into chunks of ``size`` queries, one at a time."""
    s = chunk.slots.shape[0]
    if s <= size:
        return attend(chunk)
    n = -(-s // size)
    pad = n * size - s

    def cut(a: jax.Array, axis: int) -> jax.Array:
        widths = [(0, 0)] * a.ndim
        widths[axis] = (0, pad)
        padded = jnp.pad(a, widths, mode="edge")
        return jnp.moveaxis(padded.reshape(*a.shape[:axis], n, size, *a.shape[axis + 1 :]), axis, 0)

    def cut_tokens(a: jax.Array | None) -> jax.Array | None:  # [b, s, ...] arrays
        return None if a is None else cut(a, 1)

    parts = _Chunk(cut(chunk.q, 1), cut(chunk.slots, 0), cut(chunk.positions, 1), cut_tokens(chunk.index_q),
                   cut_tokens(chunk.index_weights))
    out = jax.lax.map(lambda part: attend(_Chunk(*part)), parts)
    return jnp.moveaxis(out, 0, 1).reshape(out.shape[1], n * size, *out.shape[3:])[:, :s]


def compressor_specs(cfg: CompressedAttentionShape, kind: str, ropes: Mapping[str, Rotary]) -> dict[str, Spec]:
    """The compressors of a layer of ``kind``, by cache prefix: ``""`` the attention's (CSA, HCA) and
    ``"index_"`` the CSA indexer's."""
    rope, eps = ropes["compress"], cfg.rms_norm_eps
    specs = {} if kind == SLIDING else {"": Spec(compress_rate(cfg, kind), cfg.head_dim, kind == CSA, rope, eps)}
    if kind == CSA:
        specs["index_"] = Spec(cfg.compress_rate_csa, cfg.index_head_dim, True, rope, eps)
    return specs


def compressed_attention_forward(
    a: Params, x: jax.Array, kind: str, cfg: CompressedAttentionShape, ropes: Mapping[str, Rotary], ctx: Context,
    cache: GroupCache | None = None, q_chunk: int = Q_CHUNK,
) -> tuple[jax.Array, GroupCache | None]:
    """One V4 attention of ``x [b, s, hidden]`` and the layer's updated cache (None without one).
    Without a cache the call's tokens sit at slots ``0 .. s - 1``; ``ropes``: the ``main`` and
    ``compress`` RoPEs; queries attended ``q_chunk`` at a time."""
    b, s, _ = x.shape
    eps, positions = cfg.rms_norm_eps, ctx.positions
    cos, sin = ropes["main" if kind == SLIDING else "compress"].tables(positions)
    q_latent = rms_norm_scaled_f32(dense(a["q_a"], x, "bsh,rh->bsr"), a["q_a_norm"]["scale"], eps)
    q = dense(a["q_b"], q_latent, "bsr,ndr->bsnd")
    q32 = q.astype(jnp.float32)
    q = (q32 * jax.lax.rsqrt(jnp.mean(q32 * q32, axis=-1, keepdims=True) + eps)).astype(q.dtype)
    q = rope_tail(q, cos, sin)
    kv = rms_norm_scaled_f32(dense(a["kv"], x, "bsh,dh->bsd"), a["kv_norm"]["scale"], eps)
    kv = rope_tail(kv[:, :, None, :], cos, sin)
    specs = compressor_specs(cfg, kind, ropes)
    params = {prefix: a["indexer"]["compressor"] if prefix else a["compressor"] for prefix in specs}
    keys: dict[str, jax.Array] = {}
    if cache is None:
        slots = jnp.arange(s)
        kv = kv[:, :, 0, :]
        keys = {prefix: compressed_keys(params[prefix], x, spec) for prefix, spec in specs.items()}
    else:
        slots, updated = ctx.q_index, {"k": write_cache(cache, "k", kv, ctx)}
        kv = updated["k"][:, :, 0, :]
        real = token_mask(ctx, s)
        assert real is not None and ctx.kv_mask is not None  # a context made with a cache has its mask
        before = ctx.kv_mask.sum(axis=-1, dtype=jnp.int32) - real.sum(axis=-1, dtype=jnp.int32)
        for prefix, spec in specs.items():
            keys[prefix], state = cached_keys(params[prefix], x, real, before, cache, spec, prefix)
            updated.update(state)
        cache = updated
    index = None if kind != CSA else _indexer(a["indexer"], keys["index_"], x, q_latent, positions,
                                              ropes["compress"], cfg)
    chunk = _Chunk(q, slots, positions, None if index is None else index.q, None if index is None else index.weights)

    def attend(part: _Chunk) -> jax.Array:
        return _attend(part, kv, ctx.kv_mask, keys.get(""), index, a["sinks"], kind, cfg)

    out = rope_tail(_in_chunks(attend, chunk, q_chunk), cos, -sin)
    g = cfg.o_groups
    grouped = out.reshape(b, s, g, -1)
    mid = jnp.einsum("bsgi,gri->bsgr", grouped, a["o_a"]["kernel"]).reshape(b, s, -1)
    return dense(a["o_b"], mid, "bsr,hr->bsh"), cache
