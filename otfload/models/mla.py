"""Multi-head latent attention (MLA: DeepSeek-V2/V3, and with the DSA indexer DeepSeek-V3.2 and GLM-5).

Queries come from ``q`` (or the low-rank ``q_a`` → norm → ``q_b``); keys and values from a
compressed latent (``kv_a`` → norm → ``k_b``/``v_b`` per head) plus one shared RoPE key
(``k_rope``). The RoPE part uses DeepSeek's interleaved pair layout (or rotate-half when
``rope_interleave`` is false); YaRN scaling and its softmax ``mscale`` are supported. Attention runs
in the absorbed form (``k_b`` folded into the queries, ``v_b`` applied after attending), so the KV
cache holds the latent and the rotated key per token.

With an ``indexer`` (:mod:`otfload.models.sparse_indexer`, configs with ``index_topk``) each query
attends only to the keys the indexer scores highest; the cache row then also holds the indexer's
key, after the latent and the rotated key.

Kernels keep HF's ``[out, in]`` orientation (output dims first, e.g. ``q`` is ``(heads, head_dim,
hidden)``), so loading needs only slices and reshapes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.attention import Context, attention, write_cache
from otfload.models.base import GroupCache
from otfload.models.layers import (
    Dense,
    Norm,
    ParamOptions,
    Params,
    apply_rope,
    dense,
    rms_norm,
    rope_attention_factor,
    rope_inv_freq,
    rope_tables,
    yarn_mscale,
)
from otfload.models.sparse_indexer import Indexer, IndexerShape, index_keys, index_queries, sparse_attention

# transformers builds q_a_layernorm and kv_a_layernorm without passing rms_norm_eps.
LATENT_NORM_EPS = 1e-6
# What every layer's attention shares: RoPE ``(cos, sin)`` of the call's positions and the softmax scale.
MlaRope = tuple[jax.Array, jax.Array, float]


class MlaShape(IndexerShape, Protocol):
    """The config fields :class:`MLAttention` and :func:`mla_forward` read (``index_topk`` None: no
    indexer)."""

    @property
    def hidden_size(self) -> int: ...
    @property
    def num_attention_heads(self) -> int: ...
    @property
    def q_lora_rank(self) -> int | None: ...
    @property
    def kv_lora_rank(self) -> int: ...
    @property
    def qk_nope_head_dim(self) -> int: ...
    @property
    def qk_rope_head_dim(self) -> int: ...
    @property
    def qk_head_dim(self) -> int: ...
    @property
    def v_head_dim(self) -> int: ...
    @property
    def rope_theta(self) -> float: ...
    @property
    def rope_scaling(self) -> Mapping[str, Any] | None: ...
    @property
    def rope_interleave(self) -> bool: ...


# --- RoPE ----------------------------------------------------------------------------------------


def _rope_kind(cfg: MlaShape) -> str:
    scaling = cfg.rope_scaling or {}
    kind: str = scaling.get("rope_type", scaling.get("type", "default")) or "default"
    return kind


def softmax_scale(cfg: MlaShape) -> float:
    """``qk_head_dim ** -0.5``, times ``mscale(factor, mscale_all_dim) ** 2`` for scaled RoPE."""
    scale: float = cfg.qk_head_dim**-0.5
    mscale_all_dim = (cfg.rope_scaling or {}).get("mscale_all_dim")
    factor = (cfg.rope_scaling or {}).get("factor", 1.0)
    if _rope_kind(cfg) != "default" and mscale_all_dim and factor > 1:
        scale *= yarn_mscale(factor, mscale_all_dim) ** 2
    return scale


def mla_rope(cfg: MlaShape, positions: jax.Array) -> MlaRope:
    """The RoPE tables of ``positions [b, s]`` (YaRN's attention factor applied) and the softmax scale."""
    inv_freq = rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling)
    cos, sin = rope_tables(positions, inv_freq, rope_attention_factor(cfg.rope_scaling))
    return cos, sin, softmax_scale(cfg)


def apply_pair_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleaved: bool) -> jax.Array:
    """RoPE on ``x [b, s, h, d]``. Interleaved pairs ``(x0, x1), (x2, x3), ...`` are de-interleaved
    first, as transformers' V3 does; the result is the rotate-half rotation of ``[x_even, x_odd]``.
    V2's complex-number rotation keeps the pairs interleaved instead: a permutation of the same
    values, applied alike to queries and keys, so attention scores are identical."""
    if interleaved:
        x = jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)
    return apply_rope(x, cos, sin)


# --- parameters ----------------------------------------------------------------------------------


class MLAttention(nnx.Module):
    """Multi-head latent attention parameters; ``kv_a_proj_with_mqa`` and ``kv_b_proj`` are split
    into per-role leaves (``kv_a``/``k_rope`` and ``k_b``/``v_b``) by the mapping's hooks.

    The latents' dims as inputs (of ``q_b``, ``k_b``, ``v_b`` and the indexer's ``q``) are sharded
    like the model width (``"embed"``: fsdp, as DeepSeek-V4's), so that without a ``tp`` axis none
    of these kernels is whole on every device; ``q_a`` and ``kv_a`` keep fsdp on their ``embed`` input
    (their latent outputs, ``"q_lora"`` / ``"kv_lora"``, have no rule)."""

    def __init__(self, cfg: MlaShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        h, n = cfg.hidden_size, cfg.num_attention_heads
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        if cfg.q_lora_rank is None:
            self.q = Dense((n, cfg.qk_head_dim, h), ("heads", "head_dim", "embed"), **kw)
        else:
            self.q_a = Dense((cfg.q_lora_rank, h), ("q_lora", "embed"), **kw)
            self.q_a_norm = Norm(cfg.q_lora_rank, **kw)
            self.q_b = Dense((n, cfg.qk_head_dim, cfg.q_lora_rank), ("heads", "head_dim", "embed"), **kw)
        self.kv_a = Dense((cfg.kv_lora_rank, h), ("kv_lora", "embed"), **kw)
        self.k_rope = Dense((cfg.qk_rope_head_dim, h), ("head_dim", "embed"), **kw)
        self.kv_a_norm = Norm(cfg.kv_lora_rank, **kw)
        self.k_b = Dense((n, cfg.qk_nope_head_dim, cfg.kv_lora_rank), ("heads", "head_dim", "embed"), **kw)
        self.v_b = Dense((n, cfg.v_head_dim, cfg.kv_lora_rank), ("heads", "head_dim", "embed"), **kw)
        self.o = Dense((h, n, cfg.v_head_dim), ("embed", "heads", "head_dim"), **kw)
        if cfg.index_topk is not None:
            self.indexer = Indexer(cfg, **kw)


def cache_key_dim(cfg: MlaShape) -> int:
    """Dims of one cache row: the latent, the rotated key and (with an indexer) the indexer's key."""
    return cfg.kv_lora_rank + cfg.qk_rope_head_dim + (0 if cfg.index_topk is None else cfg.index_head_dim)


# --- layer math ----------------------------------------------------------------------------------


def mla_forward(
    a: Params, x: jax.Array, cfg: MlaShape, rope: MlaRope, ctx: Context, cache: GroupCache | None
) -> tuple[jax.Array, GroupCache | None]:
    """Multi-head latent attention in its absorbed form: ``k_b`` is folded into the queries and
    ``v_b`` applied after attending, so keys and values are the compressed latent itself (one shared
    "head" of ``kv_lora_rank + qk_rope_head_dim`` dims, the latent doubling as the value) and the
    cache holds ``[latent, rotated key]`` per token instead of per-head keys and values (then the
    indexer's key, when ``a`` has an ``indexer``: each query attends to the keys it selects)."""
    cos, sin, scale = rope
    if cfg.q_lora_rank is None:
        q_latent = None
        q = dense(a["q"], x, "bsh,ndh->bsnd")
    else:
        q_latent = rms_norm(dense(a["q_a"], x, "bsh,rh->bsr"), a["q_a_norm"]["scale"], LATENT_NORM_EPS)
        q = dense(a["q_b"], q_latent, "bsr,ndr->bsnd")
    q_nope, q_rot = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim :]
    latent = rms_norm(dense(a["kv_a"], x, "bsh,rh->bsr"), a["kv_a_norm"]["scale"], LATENT_NORM_EPS)
    k_rot = apply_pair_rope(dense(a["k_rope"], x, "bsh,dh->bsd")[:, :, None, :], cos, sin, cfg.rope_interleave)
    q_rot = apply_pair_rope(q_rot, cos, sin, cfg.rope_interleave)
    q = jnp.concatenate([jnp.einsum("bsnd,ndr->bsnr", q_nope, a["k_b"]["kernel"]), q_rot], axis=-1)
    row = [latent[:, :, None, :], k_rot.astype(latent.dtype)]
    def rotate(t: jax.Array) -> jax.Array:  # the indexer's RoPE
        return apply_pair_rope(t, cos, sin, cfg.indexer_rope_interleave)

    if "indexer" in a:
        row.append(index_keys(a["indexer"], x, rotate, cfg).astype(latent.dtype)[:, :, None, :])
    k = jnp.concatenate(row, axis=-1)
    if cache is not None:
        cache = {"k": write_cache(cache, "k", k, ctx)}
        k = cache["k"]
    key_dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    keys, values = k[..., :key_dim], k[..., : cfg.kv_lora_rank]
    if "indexer" not in a:
        out = attention(q, keys, values, ctx, scale=scale)
    else:
        assert q_latent is not None  # the config parsers require q_lora_rank with an indexer
        index_q = index_queries(a["indexer"], x, q_latent, rotate, cfg)
        out = sparse_attention(q, keys, values, ctx, scale, index_q, k[:, :, 0, key_dim:], cfg)
    out = jnp.einsum("bsnr,ndr->bsnd", out, a["v_b"]["kernel"])
    return dense(a["o"], out, "bsnd,hnd->bsh"), cache
