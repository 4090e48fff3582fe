"""A Linen-style Llama brought by the user: ``[in, out]`` kernels, one scanned decoder block.
otfload fills its parameter tree from an HF checkpoint with the shipped table
``otfload.mappings.linen_llama.TABLE`` (every projection transposed on load).

    .venv/bin/python examples/linen_llama.py [CHECKPOINT_DIR]

Without a directory it writes a tiny random Llama with transformers first and compares logits.
``forward`` is the client model: a pure function of the parameter tree (tests/mappings uses it).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from typing import Any

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # 8 simulated devices

import jax
import jax.numpy as jnp
import numpy as np

import otfload
from otfload.mappings import linen_llama
from otfload.models.layers import rope_inv_freq


def rope_frequencies(config: Mapping[str, Any], head_dim: int) -> np.ndarray:
    """RoPE inverse frequencies of an HF config (``rope_parameters`` or ``rope_theta``/``rope_scaling``),
    with Llama 3 scaling (otfload's own table of them: the model is yours, the RoPE maths is HF's)."""
    rope = dict(config.get("rope_parameters") or config.get("rope_scaling") or {})
    return rope_inv_freq(head_dim, rope.get("rope_theta", config.get("rope_theta", 10000.0)), rope)


def rms_norm(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    x32 = x.astype(jnp.float32)
    return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + eps)).astype(x.dtype) * scale


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """HF's rotate-half RoPE on ``x [batch, seq, heads, head_dim]``."""
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def forward(params: Mapping[str, Any], ids: jax.Array, config: Mapping[str, Any]) -> jax.Array:
    """Logits ``[batch, seq, vocab]`` of the Linen-style tree (scanned layers) for token ``ids``."""
    p, eps = params["params"], config.get("rms_norm_eps", 1e-6)
    x = p["token_embedder"]["embedding"][ids]
    seq = ids.shape[1]
    head_dim = p["decoder"]["layers"]["self_attention"]["query"]["kernel"].shape[-1]
    angles = jnp.arange(seq)[:, None] * rope_frequencies(config, head_dim)[None, :]
    cos, sin = (f(jnp.concatenate([angles, angles], -1))[None, :, None, :] for f in (jnp.cos, jnp.sin))
    mask = jnp.tril(jnp.ones((seq, seq), bool))

    def layer(x, w):
        a = w["self_attention"]
        h = rms_norm(x, w["pre_self_attention_layer_norm"]["scale"], eps)
        q = rotate(jnp.einsum("bse,ehd->bshd", h, a["query"]["kernel"]), cos, sin)
        k = rotate(jnp.einsum("bse,ehd->bshd", h, a["key"]["kernel"]), cos, sin)
        v = jnp.einsum("bse,ehd->bshd", h, a["value"]["kernel"])
        groups = q.shape[2] // k.shape[2]
        k, v = jnp.repeat(k, groups, 2), jnp.repeat(v, groups, 2)
        scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(head_dim)
        probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), -1)
        x = x + jnp.einsum("bqhd,hde->bqe", jnp.einsum("bhqk,bkhd->bqhd", probs, v), a["out"]["kernel"])
        h = rms_norm(x, w["post_self_attention_layer_norm"]["scale"], eps)
        m = w["mlp"]
        gated = jax.nn.silu(h @ m["wi_0"]["kernel"]) * (h @ m["wi_1"]["kernel"])
        return x + gated @ m["wo"]["kernel"], None

    x, _ = jax.lax.scan(layer, x, p["decoder"]["layers"])
    x = rms_norm(x, p["decoder"]["decoder_norm"]["scale"], eps)
    return x @ p["decoder"]["logits_dense"]["kernel"]


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
    abstract = linen_llama.abstract_params(config, mesh)
    params, report = otfload.load_params(checkpoint, abstract, linen_llama.TABLE, mesh=mesh, return_report=True)
    print(report.summary(), file=sys.stderr)
    ids = np.random.default_rng(0).integers(0, config["vocab_size"], (2, 12))
    logits = np.asarray(jax.jit(lambda p, x: forward(p, x, config))(params, ids))
    print("logits", logits.shape)
    if reference is not None:
        with torch.no_grad():
            theirs = reference(torch.as_tensor(ids)).logits.numpy()
        print(f"max relative difference to transformers: {np.abs(logits - theirs).max() / np.abs(theirs).max():.1e}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
