"""The DeepSeek-V4 decoder: embeddings spread over ``hc_mult`` hyper-connection streams
(:mod:`otfload.models.hyper_connections`), each layer an attention of its kind
(:mod:`otfload.models.compressed_attention`: sliding, CSA or HCA) and a routed MoE (hashed or
learned routing, :mod:`otfload.models.hash_moe`), each block between an RMSNorm'd collapse of the
streams and their update; then the head's collapse, the final norm and ``lm_head``.

Layers of one attention kind and one MLP kind form a group (their parameters share shapes), stacked to
scan with ``scan_layers``; a forward pass runs the groups in HF layer order
(:func:`~otfload.models.groups.run_groups`). The KV cache holds per group the sliding keys (keys
are values) and, on compressed layers, each compressor's windows and pending tokens
(:mod:`otfload.models.compressor`); the hyper-connections need none. A row holds one sequence
(``packs_sequences`` False): the compressors' windows run along the whole row.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.families.deepseek_v4.config import HASH_MOE, DeepseekV4Config, Rope
from otfload.models.attention import Context
from otfload.models.base import Cache, CacheLayout, CausalLM, GroupCache, GroupCaches
from otfload.models.compressed_attention import (
    Q_CHUNK,
    CompressedAttention,
    compressed_attention_forward,
    compressor_specs,
)
from otfload.models.compressor import Rotary, init_state
from otfload.models.groups import run_groups
from otfload.models.hash_moe import HashMoe, hash_moe_forward
from otfload.models.hyper_connections import HyperConnection, HyperHead, hc_head, hc_merge, hc_weights
from otfload.models.layers import (
    Dense,
    Embed,
    Norm,
    ParamOptions,
    Params,
    pure,
    rms_norm_scaled_f32,
    rope_attention_factor,
    rope_inv_freq,
)


class DeepseekV4Layer(nnx.Module):
    """One layer of attention kind ``kind``; ``hashed``: the MoE routes by token id."""

    def __init__(
        self, cfg: DeepseekV4Config, kind: str, hashed: bool, *, dtype: DTypeLike, rngs: nnx.Rngs | None,
        stack: int | None = None,
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.attn_hc = HyperConnection(cfg, **kw)
        self.input_norm = Norm(cfg.hidden_size, dtype=jnp.float32, rngs=rngs, stack=stack)
        self.attn = CompressedAttention(cfg, kind, **kw)
        self.ffn_hc = HyperConnection(cfg, **kw)
        self.post_attn_norm = Norm(cfg.hidden_size, dtype=jnp.float32, rngs=rngs, stack=stack)
        self.moe = HashMoe(cfg, hashed, **kw)


def rotary(cfg: DeepseekV4Config, rope: Rope) -> Rotary:
    return Rotary(rope_inv_freq(cfg.qk_rope_head_dim, rope.theta, rope.scaling), rope_attention_factor(rope.scaling))


class DeepseekV4ForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for DeepSeek-V4."""

    cfg: DeepseekV4Config
    packs_sequences = False  # the compressors' windows run along the whole row, whatever the masks say
    q_chunk: int = Q_CHUNK  # queries attended at once (static: a change retraces)

    def __init__(
        self, cfg: DeepseekV4Config, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs | None,
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        kinds = dict(zip(cfg.layer_order, zip(cfg.layer_types, cfg.mlp_layer_types, strict=True), strict=True))
        for group, layers in cfg.layer_groups.items():
            kind, mlp = kinds[group]

            def make(stack: int | None = None, kind: str = kind, mlp: str = mlp) -> DeepseekV4Layer:
                return DeepseekV4Layer(cfg, kind, mlp == HASH_MOE, dtype=dtype, rngs=rngs, stack=stack)

            setattr(self, group, make(len(layers)) if scan_layers else nnx.List([make() for _ in layers]))
        self.hc_head = HyperHead(cfg, rngs=rngs)
        self.final_norm = Norm(cfg.hidden_size, dtype=jnp.float32, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype=dtype, rngs=rngs)

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        return {group: (len(layers), 1, cfg.head_dim, 0) for group, layers in cfg.layer_groups.items()}

    def init_cache(self, batch: int, slots: int, dtype: DTypeLike | None = None) -> Cache:
        """The sliding keys of every layer and, per compressed layer, its compressors' state
        (:func:`~otfload.models.compressor.init_state`: windows in the cache's dtype, pending gates float32)."""
        cache = super().init_cache(batch, slots, dtype)
        cfg = self.cfg
        dtype = self.embed.embedding.get_value().dtype if dtype is None else dtype
        kinds = dict(zip(cfg.layer_order, cfg.layer_types, strict=True))
        for group, layers in cfg.layer_groups.items():
            for prefix, spec in compressor_specs(cfg, kinds[group], self._ropes()).items():
                state = init_state(spec, batch, slots, dtype, prefix).items()
                cache["layers"][group].update({k: jnp.broadcast_to(v, (len(layers), *v.shape)) for k, v in state})
        return cache

    def _ropes(self) -> dict[str, Rotary]:
        return {"main": rotary(self.cfg, self.cfg.main_rope), "compress": rotary(self.cfg, self.cfg.compress_rope)}

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        x = self.embed_tokens(input_ids)
        b, s, d = x.shape
        streams = jnp.broadcast_to(x[:, :, None, :], (b, s, cfg.hc_mult, d))
        ropes = self._ropes()
        kinds = dict(zip(cfg.layer_order, cfg.layer_types, strict=True))

        def layer(group: str, p: Params, h: jax.Array, cache: GroupCache | None) -> tuple[jax.Array, GroupCache | None]:
            post, comb, collapsed = hc_weights(p["attn_hc"], h, cfg)
            normed = rms_norm_scaled_f32(collapsed, p["input_norm"]["scale"], cfg.rms_norm_eps)
            out, cache = compressed_attention_forward(p["attn"], normed, kinds[group], cfg, ropes, ctx, cache,
                                                      self.q_chunk)
            h = hc_merge(post, comb, out.astype(h.dtype), h)
            post, comb, collapsed = hc_weights(p["ffn_hc"], h, cfg)
            normed = rms_norm_scaled_f32(collapsed, p["post_attn_norm"]["scale"], cfg.rms_norm_eps)
            out = hash_moe_forward(p["moe"], normed, input_ids, cfg, ctx.moe_impl)
            return hc_merge(post, comb, out.astype(h.dtype), h), cache

        groups = {group: getattr(self, group) for group in cfg.layer_groups}
        streams, new = run_groups(groups, cfg.layer_order, streams, caches, layer)
        x = hc_head(pure(self.hc_head), streams, cfg)
        return rms_norm_scaled_f32(x, self.final_norm.scale[...], cfg.rms_norm_eps), new
