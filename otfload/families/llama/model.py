"""Reference Flax NNX decoder for the Llama family: Llama 3, Mistral, Qwen2 (qkv bias) and Qwen3
(q/k RMSNorm), assembled from :mod:`otfload.models.decoder`'s pre-norm layer (GQA, RoPE incl.
Llama 3 scaling, SwiGLU, RMSNorm); tied or untied embeddings, and ``scan_layers`` (parameters
stacked on a leading ``layers`` axis, run with ``jax.lax.scan``). Kernels keep HF's ``[out, in]``
orientation (output dims first), so loading copies and reshapes only.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from flax import nnx

from otfload.families.llama.config import LlamaConfig
from otfload.models.attention import Context
from otfload.models.base import GroupCache, GroupCaches, StackedDecoderLM, group_cache
from otfload.models.decoder import DecoderLayer, layer_forward
from otfload.models.gqa import Rope
from otfload.models.layers import (
    pure,
    rms_norm,
    rope_attention_factor,
    rope_inv_freq,
    rope_tables,
    run_layers,
)


class LlamaForCausalLM(StackedDecoderLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` (masks, positions and a KV
    cache as :class:`~otfload.models.base.CausalLM` describes).

    Subclasses with other kinds of layers override :meth:`init_layers` and :meth:`decode`.
    """

    cfg: LlamaConfig
    layer_class = DecoderLayer

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

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        x, new = self.decode(self.embed_tokens(input_ids), ctx, caches)
        return rms_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps), new
