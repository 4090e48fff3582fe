"""Reference Flax NNX decoder for the Llama family: Llama 3, Mistral, Qwen2 (qkv bias) and Qwen3
(q/k RMSNorm), assembled from :mod:`otfload.models.decoder`'s pre-norm layer (GQA, RoPE incl.
Llama 3 scaling, SwiGLU, RMSNorm); tied or untied embeddings, and ``scan_layers`` (parameters
stacked on a leading ``layers`` axis, run with ``jax.lax.scan``). Kernels keep HF's ``[out, in]``
orientation (output dims first), so loading copies and reshapes only.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.llama.config import LlamaConfig
from otfload.models.attention import Context
from otfload.models.base import CacheLayout, CausalLM, GroupCache, GroupCaches, group_cache, layer_stack
from otfload.models.decoder import DecoderLayer, layer_forward
from otfload.models.gqa import Rope
from otfload.models.layers import (
    Embed,
    pure,
    rms_norm,
    rope_attention_factor,
    rope_inv_freq,
    rope_tables,
    run_layers,
)


class LlamaForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` (masks, positions and a KV
    cache as :class:`~otfload.models.base.CausalLM` describes).

    Subclasses with other kinds of layers override :meth:`init_layers` and :meth:`decode`.
    """

    cfg: LlamaConfig
    layers: nnx.Module  # one stacked decoder layer (``scan_layers``) or an ``nnx.List`` of layers

    def __init__(
        self, cfg: LlamaConfig, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.init_layers(dtype, rngs)
        self.init_output(cfg.vocab_size, cfg.hidden_size, dtype, rngs)

    def init_layers(self, dtype: DTypeLike, rngs: nnx.Rngs | None) -> None:
        """Create ``self.layers``: one stacked :class:`DecoderLayer` (scanned) or a list of them."""
        cfg = self.cfg
        self.layers = layer_stack(partial(DecoderLayer, cfg, dtype=dtype, rngs=rngs), cfg.num_hidden_layers,
                                  self.scan_layers)

    def rope(self, positions: jax.Array) -> Rope:
        """RoPE ``(cos, sin)`` tables for ``positions`` (YaRN's attention factor folded in)."""
        cfg = self.cfg
        inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        return rope_tables(positions, inv_freq, rope_attention_factor(cfg.rope_scaling))

    def decode(
        self, x: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        """Run every decoder layer on the embedded tokens ``x [batch, seq, hidden]``."""
        cfg = self.cfg
        rope = self.rope(ctx.positions)
        layers = self.layers
        params = [pure(layer) for layer in layers] if isinstance(layers, nnx.List) else pure(layers)
        x, cache = run_layers(params, x, lambda p, h, c: layer_forward(p, h, cfg, rope, ctx, c, cfg.sliding_window),
                              group_cache(caches, "layers"))
        return x, None if caches is None else {"layers": cache}

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        return {"layers": (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)}

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        x, new = self.decode(self.embed_tokens(input_ids), ctx, caches)
        return rms_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps), new
