"""The MLA decoder of DeepSeek-V2/V3/V3.2 and GLM-5: :mod:`latent attention <otfload.models.mla>`
(with the DSA indexer where the config has one), then a dense SwiGLU MLP on the first
``first_k_dense_replace`` layers and :mod:`DeepSeek's MoE <otfload.models.deepseek_moe>` on the rest.

The two kinds of layer are two homogeneous groups (``dense_layers``: HF layers ``0 ..
first_k_dense_replace - 1``, ``moe_layers``: the rest), each stacked on a leading ``layers`` axis
and run by its own scan with ``scan_layers``. The KV cache holds one row per token and layer
(:func:`~otfload.models.mla.cache_key_dim` dims: the latent, the rotated key, the indexer's key).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.attention import Context
from otfload.models.base import CacheLayout, CausalLM, GroupCache, GroupCaches, group_cache
from otfload.models.deepseek_moe import DeepseekMoe, DeepseekMoeShape, FfnDims, deepseek_moe_forward
from otfload.models.layers import Embed, Norm, ParamOptions, Params, pure, rms_norm, run_layers
from otfload.models.mla import MlaRope, MlaShape, MLAttention, cache_key_dim, mla_forward, mla_rope
from otfload.models.mlp import Mlp, swiglu

GROUPS = ("dense_layers", "moe_layers")


class MlaModelShape(MlaShape, DeepseekMoeShape, Protocol):
    """The config fields :class:`MlaForCausalLM` reads."""

    @property
    def vocab_size(self) -> int: ...
    @property
    def intermediate_size(self) -> int: ...
    @property
    def rms_norm_eps(self) -> float: ...
    @property
    def first_k_dense_replace(self) -> int: ...
    @property
    def num_moe_layers(self) -> int: ...
    @property
    def tie_word_embeddings(self) -> bool: ...
    @property
    def pad_token_id(self) -> int | None: ...


class MlaDecoderLayer(nnx.Module):
    """One layer (``stack=L``: L layers on a leading axis); ``moe`` picks routed MoE over dense MLP."""

    def __init__(
        self, cfg: MlaModelShape, *, moe: bool, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.input_norm = Norm(cfg.hidden_size, **kw)
        self.attn = MLAttention(cfg, **kw)
        self.post_attn_norm = Norm(cfg.hidden_size, **kw)
        if moe:
            self.moe = DeepseekMoe(cfg, **kw)
        else:
            self.mlp = Mlp(FfnDims(cfg.hidden_size, cfg.intermediate_size), **kw)


def mla_layer_forward(
    p: Params, x: jax.Array, cfg: MlaModelShape, rope: MlaRope, ctx: Context, cache: GroupCache | None
) -> tuple[jax.Array, GroupCache | None]:
    """One decoder layer (dense or MoE, by which parameters ``p`` holds): ``(x, updated cache)``."""
    out, cache = mla_forward(p["attn"], rms_norm(x, p["input_norm"]["scale"], cfg.rms_norm_eps), cfg, rope, ctx, cache)
    x = x + out
    h = rms_norm(x, p["post_attn_norm"]["scale"], cfg.rms_norm_eps)
    ffn = deepseek_moe_forward(p["moe"], h, cfg, ctx.moe_impl) if "moe" in p else swiglu(p["mlp"], h)
    return x + ffn, cache


def _layer_group(
    cfg: MlaModelShape, count: int, moe: bool, scan: bool, dtype: DTypeLike, rngs: nnx.Rngs | None
) -> nnx.Module | None:
    if count == 0:
        return None
    if scan:
        return MlaDecoderLayer(cfg, moe=moe, dtype=dtype, rngs=rngs, stack=count)
    return nnx.List([MlaDecoderLayer(cfg, moe=moe, dtype=dtype, rngs=rngs) for _ in range(count)])


class MlaForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for the MLA families.

    ``dense_layers`` holds HF layers ``0 .. first_k_dense_replace - 1`` and ``moe_layers`` the rest;
    with ``scan_layers`` each group is stacked on a leading ``layers`` axis and run by its own scan.
    """

    cfg: MlaModelShape

    def __init__(
        self, cfg: MlaModelShape, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32, rngs: nnx.Rngs | None
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        self.dense_layers = _layer_group(cfg, cfg.first_k_dense_replace, False, scan_layers, dtype, rngs)
        self.moe_layers = _layer_group(cfg, cfg.num_moe_layers, True, scan_layers, dtype, rngs)
        self.init_output(cfg.vocab_size, cfg.hidden_size, dtype, rngs)

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        row = (1, cache_key_dim(cfg), 0)  # one shared latent "head"; values read from it
        counts = {"dense_layers": cfg.first_k_dense_replace, "moe_layers": cfg.num_moe_layers}
        return {group: (n, *row) for group, n in counts.items() if n}

    def _run_group(
        self, name: str, x: jax.Array, rope: MlaRope, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCache | None]:
        group = self.dense_layers if name == "dense_layers" else self.moe_layers
        if group is None:
            return x, None
        params = [pure(layer) for layer in group] if isinstance(group, nnx.List) else pure(group)
        return run_layers(params, x, lambda p, h, c: mla_layer_forward(p, h, self.cfg, rope, ctx, c),
                          group_cache(caches, name))

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        x = self.embed_tokens(input_ids)
        rope = mla_rope(self.cfg, ctx.positions)
        new: dict[str, GroupCache | None] = {}
        for name in GROUPS:
            x, new[name] = self._run_group(name, x, rope, ctx, caches)
        x = rms_norm(x, self.final_norm.scale[...], self.cfg.rms_norm_eps)
        return x, None if caches is None else {k: v for k, v in new.items() if v is not None}
