"""An Equinox-style Llama brought by the user: modules are dataclass pytrees (attribute paths such
as ``layers.0.self_attn.q_proj.weight``), linear weights ``[out, in]``. otfload fills it from an HF
checkpoint with the shipped table ``otfload.mappings.pytree_llama.TABLE`` and gives back the same
dataclasses holding sharded ``jax.Array`` s.

    .venv/bin/python examples/pytree_llama.py [CHECKPOINT_DIR]

Without a directory it writes a tiny random Llama with transformers first and compares logits.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 simulated devices

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

import otfload
from otfload.mappings import pytree_llama
from otfload.models.layers import rope_inv_freq
from otfload.plan.abstract import dotted


def rope_frequencies(config: Mapping[str, Any], head_dim: int) -> np.ndarray:
    """RoPE inverse frequencies of an HF config (``rope_parameters`` or ``rope_theta``/``rope_scaling``),
    with Llama 3 scaling (otfload's own table of them: the model is yours, the RoPE maths is HF's)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    return rope_inv_freq(head_dim, rope.get("rope_theta", config.get("rope_theta", 10000.0)), rope)


def module(cls: type) -> type:
    """A dataclass registered as a pytree whose children are all its fields (Equinox's model)."""
    cls = dataclass(cls)
    return jax.tree_util.register_dataclass(cls, data_fields=[f.name for f in fields(cls)], meta_fields=[])


@module
class Linear:
    weight: Any  # [out, in]

    def __call__(self, x: jax.Array) -> jax.Array:
        return x @ self.weight.T


@module
class RMSNorm:
    weight: Any

    def __call__(self, x: jax.Array, eps: float) -> jax.Array:
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * self.weight


@module
class Attention:
    q_proj: Linear
    k_proj: Linear
    v_proj: Linear
    o_proj: Linear


@module
class MLP:
    gate_proj: Linear
    up_proj: Linear
    down_proj: Linear


@module
class Block:
    input_layernorm: RMSNorm
    self_attn: Attention
    post_attention_layernorm: RMSNorm
    mlp: MLP


@module
class Embedding:
    weight: Any


@module
class Llama:
    embed_tokens: Embedding
    layers: list
    norm: RMSNorm
    lm_head: Linear


def init(config: Mapping[str, Any], dtype: Any = jnp.float32) -> Llama:
    """A zero-filled model of ``config``'s shapes (run under ``jax.eval_shape`` for the abstract one)."""
    shapes = pytree_llama.shapes(config)

    def w(path: str) -> jax.Array:
        return jnp.zeros(shapes[path], dtype)

    def block(i: int) -> Block:
        p = f"layers.{i}"
        lin = {n: Linear(w(f"{p}.self_attn.{n}.weight")) for n in ("q_proj", "k_proj", "v_proj", "o_proj")}
        mlp = {n: Linear(w(f"{p}.mlp.{n}.weight")) for n in ("gate_proj", "up_proj", "down_proj")}
        return Block(RMSNorm(w(f"{p}.input_layernorm.weight")), Attention(**lin),
                     RMSNorm(w(f"{p}.post_attention_layernorm.weight")), MLP(**mlp))

    return Llama(Embedding(w("embed_tokens.weight")), [block(i) for i in range(config["num_hidden_layers"])],
                 RMSNorm(w("norm.weight")), Linear(w("lm_head.weight")))


def abstract_model(config: Mapping[str, Any], mesh: Mesh) -> Llama:
    """The abstract model, each leaf sharded as ``otfload.mappings.pytree_llama.spec_of`` says."""
    shapes = jax.eval_shape(lambda: init(config))
    return jax.tree_util.tree_map_with_path(
        lambda path, s: jax.ShapeDtypeStruct(
            s.shape, s.dtype, sharding=NamedSharding(mesh, pytree_llama.spec_of(dotted(path), s.shape, mesh))),
        shapes)


def forward(model: Llama, ids: jax.Array, config: Mapping[str, Any]) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` for token ``ids``."""
    eps, seq = config.get("rms_norm_eps", 1e-6), ids.shape[1]
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    angles = jnp.arange(seq)[:, None] * rope_frequencies(config, head_dim)[None, :]
    cos, sin = (f(jnp.concatenate([angles, angles], -1))[None, :, None, :] for f in (jnp.cos, jnp.sin))

    def rotate(x: jax.Array) -> jax.Array:
        half = head_dim // 2
        return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin

    x = model.embed_tokens.weight[ids]
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    for block in model.layers:
        a, h = block.self_attn, block.input_layernorm(x, eps)
        b = ids.shape[0]
        q = rotate(a.q_proj(h).reshape(b, seq, heads, head_dim))
        k = rotate(a.k_proj(h).reshape(b, seq, -1, head_dim))
        v = a.v_proj(h).reshape(b, seq, -1, head_dim)
        k, v = (jnp.repeat(t, heads // t.shape[2], 2) for t in (k, v))
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), -1)
        x = x + a.o_proj(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, seq, -1))
        h = block.post_attention_layernorm(x, eps)
        x = x + block.mlp.down_proj(jax.nn.silu(block.mlp.gate_proj(h)) * block.mlp.up_proj(h))
    return model.lm_head(model.norm(x, eps))


def main(checkpoint: str | None) -> None:
    import json
    import tempfile
    from pathlib import Path

    reference = None
    if checkpoint is None:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        checkpoint = tempfile.mkdtemp()
        torch.manual_seed(0)
        reference = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
        reference.save_pretrained(checkpoint)
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    mesh = otfload.make_mesh({"fsdp": 2, "tp": 4})
    model = otfload.load_params(checkpoint, abstract_model(config, mesh), pytree_llama.TABLE)
    print("q_proj of layer 0:", model.layers[0].self_attn.q_proj.weight.sharding.spec)
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 12))
    logits = np.asarray(jax.jit(lambda m, x: forward(m, x, config))(model, ids))
    print("logits", logits.shape)
    if reference is not None:
        with torch.no_grad():
            theirs = reference(torch.as_tensor(ids)).logits.numpy()
        print(f"max relative difference to transformers: {np.abs(logits - theirs).max() / np.abs(theirs).max():.1e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
