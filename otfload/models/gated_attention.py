"""Gated full attention (Qwen3.5, Qwen3-Next): GQA whose query projection also yields a per-head output
gate, per-head q/k RMSNorms scaled by ``1 + w``, partial rotary, and the attention output times
``sigmoid(gate)`` before the output projection.

``q`` is kept as HF stores ``q_proj`` per head: ``(heads, 2 * head_dim, hidden)``, each head's query
rows then its gate rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.attention import Context, self_attention
from otfload.models.base import GroupCache
from otfload.models.gqa import HeadShape, Rope
from otfload.models.layers import Dense, Norm, ParamOptions, Params, apply_rope, dense, rms_norm


class GatedAttention(nnx.Module):
    """q+gate ``(heads, 2 * head_dim, hidden)``, k/v ``(kv heads, head_dim, hidden)``, o ``(hidden,
    heads, head_dim)`` and the per-head q/k norms."""

    def __init__(self, cfg: HeadShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        h, n, kv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.q = Dense((n, 2 * d, h), ("heads", "head_dim", "embed"), **kw)
        self.k = Dense((kv, d, h), ("kv_heads", "head_dim", "embed"), **kw)
        self.v = Dense((kv, d, h), ("kv_heads", "head_dim", "embed"), **kw)
        self.o = Dense((h, n, d), ("embed", "heads", "head_dim"), **kw)
        self.q_norm = Norm(d, **kw)
        self.k_norm = Norm(d, **kw)


def gated_attention(
    a: Params, h: jax.Array, rope: Rope, ctx: Context, cache: GroupCache | None, eps: float
) -> tuple[jax.Array, GroupCache | None]:
    """Gated self-attention of the normed input ``h``: ``(output, the layer's updated cache)``."""
    d = a["k"]["kernel"].shape[-2]
    q, gate = jnp.split(dense(a["q"], h, "bsh,ndh->bsnd"), 2, axis=-1)
    q = apply_rope(rms_norm(q, a["q_norm"]["scale"], eps, offset=1.0), *rope)
    k = apply_rope(rms_norm(dense(a["k"], h, "bsh,ndh->bsnd"), a["k_norm"]["scale"], eps, offset=1.0), *rope)
    v = dense(a["v"], h, "bsh,ndh->bsnd")
    out, cache = self_attention(q, k, v, ctx, cache, scale=d**-0.5)
    return dense(a["o"], out * jax.nn.sigmoid(gate), "bsnd,hnd->bsh"), cache
