"""Flax NNX decoder for MiniMax-M2, assembled from :mod:`otfload.models`' blocks: pre-norm layers
(:class:`~otfload.models.decoder.GroupRoutedLayer`) with GQA attention whose q/k norms span the
whole projections (:data:`~otfload.models.gqa.WHOLE`) and RoPE on the first ``rotary_dim`` dims of
each head, and on every layer routed experts chosen by sigmoid score plus correction bias (DeepSeek's
router with one group, :mod:`otfload.models.deepseek_moe`), the top-k weights renormalised.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
from flax import nnx

from otfload.families.minimax_m2.config import MiniMaxM2Config
from otfload.models.attention import Context
from otfload.models.base import GroupCache, GroupCaches, StackedDecoderLM, group_cache
from otfload.models.decoder import GroupRoutedLayer, layer_forward
from otfload.models.deepseek_moe import deepseek_moe_forward
from otfload.models.gqa import WHOLE, gqa_rope
from otfload.models.layers import Params, pure, rms_norm, run_layers


class MiniMaxM2ForCausalLM(StackedDecoderLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for MiniMax-M2."""

    cfg: MiniMaxM2Config
    layer_class = GroupRoutedLayer
    layer_options = {"qk_norm_over": WHOLE}

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
