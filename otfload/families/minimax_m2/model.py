"""Flax NNX decoder for MiniMax-M2, assembled from :mod:`otfload.models`' blocks: pre-norm layers
(:class:`~otfload.models.decoder.GroupRoutedLayer`) with GQA attention whose q/k norms span the
whole projections (:data:`~otfload.models.gqa.WHOLE`) and RoPE on the first ``rotary_dim`` dims of
each head, and on every layer routed experts chosen by sigmoid score plus correction bias (DeepSeek's
router with one group, :mod:`otfload.models.deepseek_moe`), the top-k weights renormalised.
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import partial

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.minimax_m2.config import MiniMaxM2Config
from otfload.models.attention import Context
from otfload.models.base import CacheLayout, CausalLM, GroupCache, GroupCaches, group_cache, layer_stack
from otfload.models.decoder import GroupRoutedLayer, layer_forward
from otfload.models.deepseek_moe import deepseek_moe_forward
from otfload.models.gqa import WHOLE, gqa_rope
from otfload.models.layers import Embed, Params, pure, rms_norm, run_layers


class MiniMaxM2ForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for MiniMax-M2."""

    cfg: MiniMaxM2Config
    layers: nnx.Module  # one stacked decoder layer (``scan_layers``) or an ``nnx.List`` of layers

    def __init__(
        self, cfg: MiniMaxM2Config, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs | None,
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.layers = layer_stack(partial(GroupRoutedLayer, cfg, dtype=dtype, rngs=rngs, qk_norm_over=WHOLE),
                                  cfg.num_hidden_layers, scan_layers)
        self.init_output(cfg.vocab_size, cfg.hidden_size, dtype, rngs)

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        return {"layers": (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)}

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        rope = gqa_rope(ctx.positions, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)

        def run(p: Params, h: jax.Array, cache: GroupCache | None) -> tuple[jax.Array, GroupCache | None]:
            ffn = lambda q, y: deepseek_moe_forward(q["moe"], y, cfg, ctx.moe_impl)  # noqa: E731
            return layer_forward(p, h, cfg, rope, ctx, cache, None, ffn)

        layers = self.layers
        params = [pure(layer) for layer in layers] if isinstance(layers, nnx.List) else pure(layers)
        x, cache = run_layers(params, self.embed_tokens(input_ids), run, group_cache(caches, "layers"))
        x = rms_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps)
        return x, None if caches is None else {"layers": cache}
