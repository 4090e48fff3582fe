"""The pre-norm decoder layer: RMSNorm → :mod:`GQA attention <otfload.models.gqa>` → residual,
RMSNorm → feed-forward (:func:`~otfload.models.mlp.swiglu`, or a caller's, e.g. routed experts) →
residual (Llama 3, Mistral, Qwen2/3 and the MoE decoders built on them). :class:`DecoderLayer` holds
a dense MLP; :class:`GroupRoutedLayer` DeepSeek's routed and shared experts
(:mod:`otfload.models.deepseek_moe`, GLM-4.5, MiniMax-M2), run by passing
:func:`~otfload.models.deepseek_moe.deepseek_moe_forward` as ``ffn``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import jax
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.attention import Context, Window
from otfload.models.base import GroupCache
from otfload.models.deepseek_moe import DeepseekMoe, DeepseekMoeShape
from otfload.models.gqa import PER_HEAD, Attention, GqaShape, Rope, attention_block
from otfload.models.layers import Norm, ParamOptions, Params, rms_norm
from otfload.models.mlp import Mlp, MlpShape, swiglu


class LayerShape(GqaShape, MlpShape, Protocol):
    """The config fields :class:`DecoderLayer` and :func:`layer_forward` read."""


class DecoderLayer(nnx.Module):
    """One layer's parameters (``stack=L`` gives all L layers stacked on a leading axis)."""

    def __init__(self, cfg: LayerShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None) -> None:
        self.input_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs, stack=stack)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, stack=stack)
        self.post_attn_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs, stack=stack)
        self.mlp = Mlp(cfg, dtype=dtype, rngs=rngs, stack=stack)


class GroupRoutedShape(GqaShape, DeepseekMoeShape, Protocol):
    """The config fields :class:`GroupRoutedLayer` reads."""


class GroupRoutedLayer(nnx.Module):
    """A layer whose feed-forward is DeepSeek's routed-plus-shared experts (``moe``); ``qk_norm_over``
    as :class:`~otfload.models.gqa.Attention` takes it."""

    def __init__(
        self, cfg: GroupRoutedShape, *, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None,
        qk_norm_over: str = PER_HEAD,
    ) -> None:
        kw = ParamOptions(dtype=dtype, rngs=rngs, stack=stack)
        self.input_norm = Norm(cfg.hidden_size, **kw)
        self.attn = Attention(cfg, qk_norm_over=qk_norm_over, **kw)
        self.post_attn_norm = Norm(cfg.hidden_size, **kw)
        self.moe = DeepseekMoe(cfg, **kw)


def layer_forward(
    p: Params,
    x: jax.Array,
    cfg: GqaShape,
    rope: Rope,
    ctx: Context,
    cache: GroupCache | None = None,
    window: Window | None = None,
    ffn: Callable[[Params, jax.Array], jax.Array] | None = None,
) -> tuple[jax.Array, GroupCache | None]:
    """One decoder layer as a pure function of its parameter dict ``p``: ``(x, updated cache)``;
    ``ffn(p, h)`` replaces the SwiGLU MLP of ``p["mlp"]`` (MoE layers)."""
    h = rms_norm(x, p["input_norm"]["scale"], cfg.rms_norm_eps)
    out, cache = attention_block(p["attn"], h, cfg, rope, ctx, cache, window)
    x = x + out
    h = rms_norm(x, p["post_attn_norm"]["scale"], cfg.rms_norm_eps)
    return x + (swiglu(p["mlp"], h) if ffn is None else ffn(p, h)), cache
