"""Flax NNX decoder for GLM-4.5 / GLM-4.6, assembled from :mod:`otfload.models`' blocks: pre-norm
layers (:mod:`otfload.models.decoder`) with GQA attention (q/k/v biases, optional per-head q/k
norms, RoPE on the first ``rotary_dim`` dims of each head); the first ``first_k_dense_replace``
layers have a dense SwiGLU MLP, the rest DeepSeek-V3's routed experts
(:mod:`otfload.models.deepseek_moe`: sigmoid scores, groups, correction bias, shared experts).

The two kinds of layer are two groups, ``dense_layers`` (HF layers ``0 .. first_k_dense_replace -
1``) and ``moe_layers`` (the rest), each stacked and scanned on its own with ``scan_layers``.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.glm4_moe.config import Glm4MoeConfig
from otfload.models.attention import Context
from otfload.models.base import CacheLayout, CausalLM, GroupCache, GroupCaches, group_cache
from otfload.models.decoder import DecoderLayer, GroupRoutedLayer, layer_forward
from otfload.models.deepseek_moe import deepseek_moe_forward
from otfload.models.gqa import gqa_rope
from otfload.models.layers import (
    Embed,
    Params,
    pure,
    rms_norm,
    run_layers,
)


class Glm4MoeForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for GLM-4.5 / GLM-4.6."""

    cfg: Glm4MoeConfig

    def __init__(
        self, cfg: Glm4MoeConfig, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.dense_layers = self._group(DecoderLayer, cfg.first_k_dense_replace, dtype, rngs)
        self.moe_layers = self._group(GroupRoutedLayer, cfg.num_moe_layers, dtype, rngs)
        self.init_output(cfg.vocab_size, cfg.hidden_size, dtype, rngs)

    def _group(
        self, layer: type[DecoderLayer] | type[GroupRoutedLayer], n: int, dtype: DTypeLike, rngs: nnx.Rngs | None
    ) -> nnx.Module | None:
        if n == 0:
            return None
        if self.scan_layers:
            return layer(self.cfg, dtype=dtype, rngs=rngs, stack=n)
        return nnx.List([layer(self.cfg, dtype=dtype, rngs=rngs) for _ in range(n)])

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        shape = (cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)
        counts = {"dense_layers": cfg.first_k_dense_replace, "moe_layers": cfg.num_moe_layers}
        return {group: (n, *shape) for group, n in counts.items() if n}

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        rope = gqa_rope(ctx.positions, cfg.rotary_dim, cfg.rope_theta, cfg.rope_scaling)

        def run(p: Params, h: jax.Array, cache: GroupCache | None) -> tuple[jax.Array, GroupCache | None]:
            ffn = (lambda q, y: deepseek_moe_forward(q["moe"], y, cfg, ctx.moe_impl)) if "moe" in p else None
            return layer_forward(p, h, cfg, rope, ctx, cache, None, ffn)

        x = self.embed_tokens(input_ids)
        new: dict[str, GroupCache | None] = {}
        for name in ("dense_layers", "moe_layers"):
            layers = getattr(self, name)
            if layers is None:
                continue
            params = [pure(layer) for layer in layers] if isinstance(layers, nnx.List) else pure(layers)
            x, new[name] = run_layers(params, x, run, group_cache(caches, name))
        x = rms_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps)
        return x, None if caches is None else {k: v for k, v in new.items() if v is not None}
