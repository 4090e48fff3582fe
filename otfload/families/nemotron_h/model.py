"""Flax NNX decoder for Nemotron-H, mirroring transformers 5.24's ``NemotronHModel``: each layer is
``x + mixer(RMSNorm(x))`` (the norm's scale applied in float32), the mixer a Mamba-2 layer
(:mod:`otfload.models.mamba2`), GQA attention without positional encoding
(:func:`~otfload.models.gqa.attention_block` with no RoPE), an ungated squared-ReLU MLP, or routed
squared-ReLU experts (sigmoid scores with the correction bias choosing the top k within the best
groups: DeepSeek's router, :mod:`otfload.models.deepseek_moe`) plus a shared ungated MLP.

Each block kind is a group of its own shapes (``mamba_layers``, ``attention_layers``, ``mlp_layers``,
``moe_layers``), run in HF layer order by :func:`otfload.models.groups.run_groups`. The cache holds
the attention layers' keys and values and, per Mamba-2 layer, the convolution's last inputs and the
float32 state. The model packs no sequences (``packs_sequences``: lm-eval's backend scores one request
a row); a row given several (``segments``) is refused: the state would run from one into the next.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from otfload.errors import UnsupportedModelError
from otfload.families.nemotron_h.config import ATTENTION, GROUP_OF, MAMBA, MLP, NemotronHConfig
from otfload.models.attention import Context, token_mask
from otfload.models.base import Cache, CacheLayout, CausalLM, GroupCache, GroupCaches, layer_stack
from otfload.models.deepseek_moe import FfnDims, Router, deepseek_moe_forward
from otfload.models.gqa import Attention, attention_block
from otfload.models.groups import run_groups
from otfload.models.layers import Dense, Embed, ExpertDense, Norm, ParamOptions, Params, rms_norm_scaled_f32
from otfload.models.mamba2 import Mamba2, conv_dim, mamba2_forward
from otfload.models.mlp import UpDownMlp, relu2, relu2_mlp

KIND_OF = {group: kind for kind, group in GROUP_OF.items()}


class SquaredReluExperts(nnx.Module):
    """Routed experts' ``up (E, moe_intermediate, d)`` and ``down (E, d, moe_intermediate)`` kernels
    (HF's per-expert ``[out, in]``), no gate; ``d`` is ``moe_latent_size`` when set, else the hidden size."""

    def __init__(
        self, cfg: NemotronHConfig, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        e, h, m = cfg.num_experts, cfg.moe_latent_size or cfg.hidden_size, cfg.moe_intermediate_size
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.up = ExpertDense(e, (m, h), ("mlp", "embed"), bias=False, **kw)
        self.down = ExpertDense(e, (h, m), ("embed", "mlp"), bias=False, **kw)


class NemotronHMoe(nnx.Module):
    """The router (kernel and correction bias), the routed experts and the shared ungated MLP; with
    ``moe_latent_size``, the projections into the experts' latent width and back (``latent_in``
    ``(latent, hidden)``, ``latent_out`` ``(hidden, latent)``, biased as the MLPs)."""

    def __init__(
        self, cfg: NemotronHConfig, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.router = Router(cfg, **kw)
        if cfg.moe_latent_size:
            latent, h, bias = cfg.moe_latent_size, cfg.hidden_size, (0,) if cfg.mlp_bias else ()
            self.latent_in = Dense((latent, h), ("mlp", "embed"), bias_dims=bias, **kw)
            self.latent_out = Dense((h, latent), ("embed", "mlp"), bias_dims=bias, **kw)
        self.experts = SquaredReluExperts(cfg, **kw)
        self.shared = UpDownMlp(FfnDims(cfg.hidden_size, cfg.moe_shared_expert_intermediate_size, cfg.mlp_bias), **kw)


class NemotronHBlock(nnx.Module):
    """One layer's parameters of block ``kind``: ``norm`` and ``mixer`` (``stack=L``: L layers)."""

    def __init__(
        self, cfg: NemotronHConfig, kind: str, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.norm = Norm(cfg.hidden_size, **kw)
        self.mixer: nnx.Module
        if kind == MAMBA:
            self.mixer = Mamba2(cfg, **kw)
        elif kind == ATTENTION:
            self.mixer = Attention(cfg, **kw)
        elif kind == MLP:
            self.mixer = UpDownMlp(cfg, **kw)
        else:
            self.mixer = NemotronHMoe(cfg, **kw)


def block_forward(
    kind: str, p: Params, x: jax.Array, cfg: NemotronHConfig, ctx: Context, cache: GroupCache | None
) -> tuple[jax.Array, GroupCache | None]:
    """One layer of block ``kind``: ``(x, updated cache)``."""
    h = rms_norm_scaled_f32(x, p["norm"]["scale"], cfg.layer_norm_epsilon)
    m = p["mixer"]
    if kind == MAMBA:
        out, cache = mamba2_forward(m, h, cfg, token_mask(ctx, x.shape[1]), cache)
    elif kind == ATTENTION:
        out, cache = attention_block(m, h, cfg, None, ctx, cache)
    elif kind == MLP:
        out = relu2_mlp(m, h)
    else:
        out = deepseek_moe_forward(m, h, cfg, ctx.moe_impl, relu2, relu2_mlp)
    return x + out, cache


class NemotronHForCausalLM(CausalLM):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for Nemotron-H."""

    cfg: NemotronHConfig
    packs_sequences = False  # Mamba-2 layers: a recurrent state along the row

    def __init__(
        self, cfg: NemotronHConfig, *, scan_layers: bool = True, dtype: DTypeLike = jnp.float32,
        rngs: nnx.Rngs | None,
    ) -> None:
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        for group in self._groups():
            block = functools.partial(NemotronHBlock, cfg, KIND_OF[group], dtype=dtype, rngs=rngs)
            setattr(self, group, layer_stack(block, len(getattr(cfg, group)), scan_layers))
        self.init_output(cfg.vocab_size, cfg.hidden_size, dtype, rngs)

    def _groups(self) -> list[str]:
        """The groups that have layers."""
        return [group for group in KIND_OF if getattr(self.cfg, group)]

    def cache_layout(self) -> dict[str, CacheLayout]:
        cfg = self.cfg
        n = len(cfg.attention_layers)
        return {"attention_layers": (n, cfg.num_key_value_heads, cfg.head_dim, cfg.head_dim)} if n else {}

    def init_cache(self, batch: int, slots: int, dtype: DTypeLike | None = None) -> Cache:
        """The KV cache of the attention layers, and per Mamba-2 layer ``conv [b, conv_dim, K]`` (in
        the cache's dtype) and ``state [b, heads, head_dim, ssm_state_size]`` (float32), as transformers
        keeps them."""
        cache = super().init_cache(batch, slots, dtype)
        cfg, n = self.cfg, len(self.cfg.mamba_layers)
        if n:
            conv_dtype = self.embed.embedding.get_value().dtype if dtype is None else dtype
            conv = jnp.zeros((n, batch, conv_dim(cfg), cfg.conv_kernel), conv_dtype)
            state = jnp.zeros((n, batch, cfg.mamba_num_heads, cfg.mamba_head_dim, cfg.ssm_state_size), jnp.float32)
            cache["layers"]["mamba_layers"] = {"conv": conv, "state": state}
        return cache

    def forward(
        self, input_ids: jax.Array, ctx: Context, caches: Mapping[str, GroupCache] | None
    ) -> tuple[jax.Array, GroupCaches | None]:
        cfg = self.cfg
        if ctx.segments is not None and cfg.mamba_layers:
            raise UnsupportedModelError("nemotron_h: rows packing several sequences (segments) are not supported: "
                                        "a Mamba-2 layer's state runs along the whole row")
        groups: dict[str, Any] = {group: getattr(self, group) for group in self._groups()}

        def layer(group: str, p: Params, h: jax.Array, c: GroupCache | None) -> tuple[jax.Array, GroupCache | None]:
            return block_forward(KIND_OF[group], p, h, cfg, ctx, c)

        order = [GROUP_OF[kind] for kind in cfg.layers_block_type]
        x, new = run_groups(groups, order, self.embed_tokens(input_ids), caches, layer)
        return rms_norm_scaled_f32(x, self.final_norm.scale[...], cfg.layer_norm_epsilon), new
