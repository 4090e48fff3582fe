"""Reference Flax NNX decoder for Gemma 2 and Gemma 3 (text): RMSNorm scaled by ``(1 + w)``,
embeddings × √hidden, norms before and after both attention and MLP, GeGLU, attention and final
logit soft-capping (Gemma 2), q/k norm (Gemma 3) and a per-layer sliding/global attention pattern
with its own RoPE per layer type.

With ``scan_layers`` every layer's parameters sit in one stack (the layers are homogeneous in
shape); the per-layer attention type is scanned over as data beside them.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from otfload.errors import UnsupportedModelError
from otfload.models.layers import (
    Dense,
    Embed,
    Norm,
    apply_rope,
    attention,
    causal_mask,
    dense,
    pure,
    rms_norm,
    rope_inv_freq,
    rope_tables,
)
from otfload.models.llama import Attention, Mlp, rope_params

SLIDING, FULL = "sliding_attention", "full_attention"
# transformers' activation name -> whether GELU uses the tanh approximation.
_GELU_APPROXIMATE = {"gelu_pytorch_tanh": True, "gelu_new": True, "gelu_fast": True, "gelu": False}

Rope = tuple[float, dict | None]  # (theta, scaling)


def _rope_of(params: dict | None, default_theta: float) -> Rope:
    params = params or {}
    kind = params.get("rope_type", params.get("type", "default"))
    return float(params.get("rope_theta", default_theta)), (params if kind != "default" else None)


def _gemma3_ropes(hf: dict) -> tuple[Rope, Rope]:
    """``(global, local)`` RoPE of Gemma 3: per layer type in transformers 5 configs, else the
    older ``rope_theta`` / ``rope_scaling`` (global) and ``rope_local_base_freq`` (local) fields."""
    params = hf.get("rope_parameters") or {}
    if FULL in params or SLIDING in params:
        return _rope_of(params.get(FULL), 1e6), _rope_of(params.get(SLIDING), 1e4)
    full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1e6)}
    return _rope_of(full, 1e6), _rope_of({"rope_theta": hf.get("rope_local_base_freq", 1e4)}, 1e4)


def _layer_types(hf: dict) -> tuple[str, ...]:
    """Each layer's attention type; without ``layer_types``, every ``pattern``-th layer is global."""
    types = hf.get("layer_types")
    if types is None:
        default = 2 if hf["model_type"] == "gemma2" else 6
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or default
        types = [SLIDING if (i + 1) % pattern else FULL for i in range(hf["num_hidden_layers"])]
    unknown = sorted(set(types) - {SLIDING, FULL})
    if unknown:
        raise UnsupportedModelError(f"{hf['model_type']}: unsupported layer types {unknown}")
    return tuple(types)


@dataclass(frozen=True)
class GemmaConfig:
    """Gemma 2 / Gemma 3 text config. Field names shared with :class:`LlamaConfig` let the Llama
    attention and MLP parameter modules (and mapping rules) serve Gemma unchanged."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    query_pre_attn_scalar: float
    sliding_window: int | None
    layer_types: tuple[str, ...]
    rope_global: Rope
    rope_local: Rope
    gelu_approximate: bool
    attn_softcap: float | None
    final_softcap: float | None
    qk_norm: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool = False

    @classmethod
    def from_hf(cls, hf: dict) -> GemmaConfig:
        """Parse ``config.json``; absent fields take transformers' Gemma defaults."""
        model_type = hf["model_type"]
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError(f"{model_type}: use_bidirectional_attention is not supported")
        activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
        if activation not in _GELU_APPROXIMATE:
            raise UnsupportedModelError(f"{model_type}: unsupported hidden_activation {activation!r}")
        gemma2 = model_type == "gemma2"
        if gemma2:
            rope_global = rope_local = rope_params(hf)
        else:
            rope_global, rope_local = _gemma3_ropes(hf)
        heads = hf["num_attention_heads"]
        bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim", 256),
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
            sliding_window=hf.get("sliding_window", 4096),
            layer_types=_layer_types(hf),
            rope_global=rope_global,
            rope_local=rope_local,
            gelu_approximate=_GELU_APPROXIMATE[activation],
            # transformers' Gemma 3 attention never soft-caps its logits, whatever the config says.
            attn_softcap=hf.get("attn_logit_softcapping", 50.0) if gemma2 else None,
            final_softcap=hf.get("final_logit_softcapping", 30.0 if gemma2 else None),
            qk_norm=not gemma2,
            qkv_bias=bias,
            o_bias=bias,
        )

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class GemmaDecoderLayer(nnx.Module):
    """One layer's parameters (``stack=L`` gives all L layers stacked on a leading axis)."""

    def __init__(self, cfg: GemmaConfig, *, dtype, rngs, stack=None):
        h = cfg.hidden_size
        self.input_norm = Norm(h, dtype=dtype, rngs=rngs, stack=stack)
        self.attn = Attention(cfg, dtype=dtype, rngs=rngs, stack=stack)
        self.post_attn_norm = Norm(h, dtype=dtype, rngs=rngs, stack=stack)
        self.pre_ffw_norm = Norm(h, dtype=dtype, rngs=rngs, stack=stack)
        self.mlp = Mlp(cfg, dtype=dtype, rngs=rngs, stack=stack)
        self.post_ffw_norm = Norm(h, dtype=dtype, rngs=rngs, stack=stack)


def gemma_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """Gemma's RMSNorm: normalise and multiply by ``1 + scale`` both in float32, then cast back
    (Llama casts before the multiply)."""
    return rms_norm(x.astype(jnp.float32), scale, eps, offset=1.0).astype(x.dtype)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
    return x if cap is None else jnp.tanh(x / cap) * cap


def layer_forward(p: dict, x: jax.Array, cfg: GemmaConfig, rope: tuple, mask: jax.Array) -> jax.Array:
    """One decoder layer as a pure function of its parameter dict ``p``; ``rope`` is ``(cos, sin)``
    and ``mask`` the ``[seq, seq]`` attention mask of this layer's attention type."""
    a, m, eps = p["attn"], p["mlp"], cfg.rms_norm_eps
    h = gemma_norm(x, p["input_norm"]["scale"], eps)
    q = dense(a["q"], h, "bsh,ndh->bsnd")
    k = dense(a["k"], h, "bsh,ndh->bsnd")
    v = dense(a["v"], h, "bsh,ndh->bsnd")
    if cfg.qk_norm:
        q = gemma_norm(q, a["q_norm"]["scale"], eps)
        k = gemma_norm(k, a["k_norm"]["scale"], eps)
    q, k = apply_rope(q, *rope), apply_rope(k, *rope)
    out = attention(q, k, v, mask, cfg.query_pre_attn_scalar**-0.5, cfg.attn_softcap)
    x = x + gemma_norm(dense(a["o"], out, "bsnd,hnd->bsh"), p["post_attn_norm"]["scale"], eps)
    h = gemma_norm(x, p["pre_ffw_norm"]["scale"], eps)
    gate = jax.nn.gelu(dense(m["gate"], h, "bsh,mh->bsm"), approximate=cfg.gelu_approximate)
    out = dense(m["down"], gate * dense(m["up"], h, "bsh,mh->bsm"), "bsm,hm->bsh")
    return x + gemma_norm(out, p["post_ffw_norm"]["scale"], eps)


class GemmaForCausalLM(nnx.Module):
    """``model(input_ids [batch, seq]) -> logits [batch, seq, vocab]`` for Gemma 2 and Gemma 3 text."""

    def __init__(self, cfg: GemmaConfig, *, scan_layers: bool = True, dtype=jnp.float32, rngs: nnx.Rngs):
        self.cfg = cfg
        self.scan_layers = scan_layers
        self.embed = Embed(cfg.vocab_size, cfg.hidden_size, dtype=dtype, rngs=rngs)
        if scan_layers:
            self.layers = GemmaDecoderLayer(cfg, dtype=dtype, rngs=rngs, stack=cfg.num_layers)
        else:
            self.layers = nnx.List([GemmaDecoderLayer(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = Norm(cfg.hidden_size, dtype=dtype, rngs=rngs)
        if not cfg.tie_word_embeddings:
            self.lm_head = Dense((cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), dtype=dtype, rngs=rngs)

    def __call__(self, input_ids: jax.Array) -> jax.Array:
        cfg = self.cfg
        embedding = self.embed.embedding[...]
        # transformers multiplies by √hidden rounded to the activation dtype.
        x = embedding[input_ids] * jnp.asarray(cfg.hidden_size**0.5, embedding.dtype)
        seq = input_ids.shape[1]
        positions = jnp.broadcast_to(jnp.arange(seq), input_ids.shape)
        # (rope, mask) of each attention type; a layer picks one with its sliding flag.
        sliding = (rope_tables(positions, rope_inv_freq(cfg.head_dim, *cfg.rope_local)),
                   causal_mask(seq, cfg.sliding_window))
        full = (rope_tables(positions, rope_inv_freq(cfg.head_dim, *cfg.rope_global)), causal_mask(seq))
        flags = np.array([t == SLIDING for t in cfg.layer_types])

        def run_layer(h, p, is_sliding):
            rope, mask = jax.tree.map(lambda s, f: jnp.where(is_sliding, s, f), sliding, full)
            return layer_forward(p, h, cfg, rope, mask)

        if self.scan_layers:
            x, _ = jax.lax.scan(lambda h, xs: (run_layer(h, *xs), None), x, (pure(self.layers), jnp.asarray(flags)))
        else:
            for layer, is_sliding in zip(self.layers, flags, strict=True):
                x = run_layer(x, pure(layer), is_sliding)
        x = gemma_norm(x, self.final_norm.scale[...], cfg.rms_norm_eps)
        logits = jnp.einsum("bsh,vh->bsv", x, embedding if cfg.tie_word_embeddings else self.lm_head.kernel[...])
        return softcap(logits, cfg.final_softcap)
