"""DeepSeek Sparse Attention (DSA): the lightning indexer and attention over the keys it selects
(DeepSeek-V3.2, GLM-5), as transformers' ``DeepseekV32Indexer`` computes it.

The indexer has its own small projections: queries ``q`` from the attention's query latent
(``[index_heads, index_head_dim, q_lora_rank]``), one shared key ``k`` from the hidden state with a
LayerNorm ``k_norm`` (scale and bias), and per-head weights ``head_weights`` ``[index_heads,
hidden]``. RoPE rotates the first ``qk_rope_head_dim`` dims of its queries and keys (interleaved
pairs or rotate-half: ``indexer_rope_interleave``). A query's score for a key is
``sum_h w_h * relu(q_h . k / sqrt(index_head_dim))`` with ``w = head_weights(x) / sqrt(index_heads)``
(float32); each query attends to the ``index_topk`` visible keys it scores highest, or to every
visible key while there are no more than ``index_topk`` of them. Transformers' reference skips the
published kernels' Hadamard rotation (orthogonal: scores unchanged) and FP8 scoring; so does this.

:func:`sparse_attention` runs per chunk of :data:`Q_CHUNK` queries: the chunk's scores against
every key slot (``[b, chunk, index_heads, slots]``), its top keys, and attention over the gathered
keys only, so memory is linear in the sequence and attention costs ``index_topk`` keys per query
(the scores still cost every key, as the indexer's do anywhere). A model's ``attention_impl`` does
not apply to these layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.attention import MASKED, Context
from otfload.models.layers import Dense, ParamOptions, Params, dense, make_param

# Queries attended at once: a chunk's scores are [b, Q_CHUNK, index_heads, slots] float32.
Q_CHUNK = 64
# transformers' indexer LayerNorm (``nn.LayerNorm(index_head_dim, eps=1e-6)``).
KEY_NORM_EPS = 1e-6
# Rotates the leading RoPE dims of ``[b, s, heads, rope_dims]`` at the call's positions.
Rotate = Callable[[jax.Array], jax.Array]


class IndexerShape(Protocol):
    """The config fields the indexer reads (``index_topk`` None: no indexer)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def q_lora_rank(self) -> int | None: ...
    @property
    def qk_rope_head_dim(self) -> int: ...
    @property
    def index_topk(self) -> int | None: ...
    @property
    def index_n_heads(self) -> int: ...
    @property
    def index_head_dim(self) -> int: ...
    @property
    def indexer_rope_interleave(self) -> bool: ...


class LayerNorm(nnx.Module):
    """A LayerNorm's ``scale`` and ``bias``."""

    def __init__(self, dim: int, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        self.scale = make_param(rngs, (dim,), ("norm",), dtype, stack)
        self.bias = make_param(rngs, (dim,), ("norm",), dtype, stack)


class Indexer(nnx.Module):
    """The indexer's parameters (HF ``self_attn.indexer``: ``wq_b``, ``wk``, ``k_norm``, ``weights_proj``)."""

    def __init__(self, cfg: IndexerShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        if cfg.q_lora_rank is None:
            raise ValueError("the DSA indexer reads the query latent: q_lora_rank must be set")
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        heads, dim = cfg.index_n_heads, cfg.index_head_dim
        self.q = Dense((heads, dim, cfg.q_lora_rank), ("heads", "head_dim", "embed"), **kw)  # as MLA's q_b
        self.k = Dense((dim, cfg.hidden_size), ("head_dim", "embed"), **kw)
        self.k_norm = LayerNorm(dim, **kw)
        self.head_weights = Dense((heads, cfg.hidden_size), ("heads", "embed"), **kw)


class IndexQueries(NamedTuple):
    """The indexer's side of a call: rotated queries ``[b, s, heads, dim]`` and float32 head
    weights ``[b, s, heads]`` (``1 / sqrt(index_heads)`` applied)."""

    q: jax.Array
    weights: jax.Array


def _rotate_leading(x: jax.Array, rotate: Rotate, rope_dims: int) -> jax.Array:
    return jnp.concatenate([rotate(x[..., :rope_dims]), x[..., rope_dims:]], axis=-1)


def index_keys(p: Params, x: jax.Array, rotate: Rotate, cfg: IndexerShape) -> jax.Array:
    """The indexer's key of each token ``[b, s, index_head_dim]``: ``k_norm(k(x))``, RoPE on its leading dims."""
    k = dense(p["k"], x, "bsh,dh->bsd").astype(jnp.float32)
    mean = k.mean(-1, keepdims=True)
    var = jnp.square(k - mean).mean(-1, keepdims=True)
    k = (k - mean) * jax.lax.rsqrt(var + KEY_NORM_EPS)
    k = (k * p["k_norm"]["scale"].astype(jnp.float32) + p["k_norm"]["bias"].astype(jnp.float32)).astype(x.dtype)
    return _rotate_leading(k[:, :, None, :], rotate, cfg.qk_rope_head_dim)[:, :, 0, :]


def index_queries(p: Params, x: jax.Array, q_latent: jax.Array, rotate: Rotate, cfg: IndexerShape) -> IndexQueries:
    """The indexer's queries (from the attention's query latent) and head weights of each token."""
    q = _rotate_leading(dense(p["q"], q_latent, "bsr,ndr->bsnd"), rotate, cfg.qk_rope_head_dim)
    kernel = p["head_weights"]["kernel"].astype(jnp.float32)
    weights = jnp.einsum("bsh,nh->bsn", x.astype(jnp.float32), kernel)
    return IndexQueries(q, weights * cfg.index_n_heads**-0.5)


def _visible(ctx: Context, q_slots: jax.Array, slots: int) -> jax.Array:
    """``[b, chunk, slots]`` (or ``[1, ...]``): which key slots each query at ``q_slots`` may see
    (causal, the padding mask, a packed row's segments: :mod:`otfload.models.attention`'s rules)."""
    k_slots = jnp.arange(slots)
    visible = (k_slots[None, :] <= q_slots[:, None])[None]
    if ctx.kv_mask is not None:
        visible = visible & ctx.kv_mask[:, None, :]
    if ctx.segments is not None and ctx.prefixes is not None:
        own, prefix = (jnp.take(a, q_slots, axis=1)[:, :, None] for a in (ctx.segments, ctx.prefixes))
        keys = ctx.segments[:, None, :]
        visible = visible & ((keys == own) | (keys == prefix))
    return visible


def _gather(table: jax.Array, rows: jax.Array) -> jax.Array:
    """``table [b, slots, d]`` at ``rows [b, c, k]`` → ``[b, c, k, d]``."""
    return jnp.take_along_axis(table[:, None], rows[..., None], axis=2)


def sparse_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    ctx: Context,
    scale: float,
    index_q: IndexQueries,
    index_k: jax.Array,
    cfg: IndexerShape,
) -> jax.Array:
    """Attention of ``q [b, s, heads, dk]`` over one shared key/value head (``k [b, slots, 1, dk]``,
    ``v [b, slots, 1, dv]``), each query over the visible keys the indexer selects (``index_q`` for
    the queries, ``index_k [b, slots, index_head_dim]`` for every slot) → ``[b, s, heads, dv]``."""
    b, s = q.shape[:2]
    slots = k.shape[1]
    top = slots if cfg.index_topk is None else min(cfg.index_topk, slots)
    keys, values = k[:, :, 0], v[:, :, 0]
    index_k = index_k.astype(jnp.float32)
    score_scale = cfg.index_head_dim**-0.5

    def attend(chunk: tuple[jax.Array, jax.Array, jax.Array, jax.Array]) -> jax.Array:
        qc, iq, w, q_slots = chunk
        scores = jax.nn.relu(jnp.einsum("bcnd,btd->bcnt", iq.astype(jnp.float32), index_k) * score_scale)
        scores = jnp.einsum("bcn,bcnt->bct", w, scores)
        visible = _visible(ctx, q_slots, slots)
        _, chosen = jax.lax.top_k(jnp.where(visible, scores, -jnp.inf), top)  # [b, c, top]
        seen = jnp.take_along_axis(jnp.broadcast_to(visible, scores.shape), chosen, axis=-1)
        kc, vc = _gather(keys, chosen), _gather(values, chosen)  # [b, c, top, d]
        logits = jnp.einsum("bcnd,bckd->bcnk", qc, kc, preferred_element_type=jnp.float32) * scale
        probs = jax.nn.softmax(jnp.where(seen[:, :, None, :], logits, MASKED), axis=-1).astype(values.dtype)
        return jnp.einsum("bcnk,bckd->bcnd", probs, vc)

    if s <= Q_CHUNK:
        return attend((q, index_q.q, index_q.weights, ctx.q_index))
    chunks = -(-s // Q_CHUNK)
    pad = chunks * Q_CHUNK - s

    def split(a: jax.Array) -> jax.Array:  # [b, s, ...] -> [chunks, b, Q_CHUNK, ...]
        a = jnp.pad(a, [(0, 0), (0, pad)] + [(0, 0)] * (a.ndim - 2))
        return jnp.moveaxis(a.reshape(b, chunks, Q_CHUNK, *a.shape[2:]), 1, 0)

    q_slots = jnp.pad(ctx.q_index, (0, pad), mode="edge").reshape(chunks, Q_CHUNK)
    out = jax.lax.map(attend, (split(q), split(index_q.q), split(index_q.weights), q_slots))
    return jnp.moveaxis(out, 0, 1).reshape(b, chunks * Q_CHUNK, *out.shape[3:])[:, :s]
