"""Shared test helpers: tiny random transformers models saved as multi-shard HF checkpoints, and
logits parity against transformers' PyTorch forward pass (the independent reference)."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np

# Small enough to build in well under a second, big enough that every leaf is shardable on 2x4.
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 500000.0}


def _llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**BASE, "rope_parameters": LLAMA3_ROPE, **kw}))


def _mistral(**kw):
    from transformers import MistralConfig, MistralForCausalLM

    return MistralForCausalLM(MistralConfig(**{**BASE, "sliding_window": 8, **kw}))


def _qwen2(**kw):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**{**BASE, **kw}))


def _qwen3(**kw):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    return Qwen3ForCausalLM(Qwen3Config(**{**BASE, "head_dim": 32, **kw}))


# name -> (constructor, kwargs, torch dtype name)
HF_MODELS: dict[str, tuple[Callable, dict, str]] = {
    "llama": (_llama, {}, "float32"),
    "llama_tied": (_llama, {"tie_word_embeddings": True}, "float32"),
    "llama_bf16": (_llama, {}, "bfloat16"),
    "mistral": (_mistral, {}, "float32"),
    "qwen2": (_qwen2, {}, "float32"),
    "qwen2_tied": (_qwen2, {"tie_word_embeddings": True}, "float32"),
    "qwen3": (_qwen3, {}, "float32"),
    "qwen3_tied": (_qwen3, {"tie_word_embeddings": True}, "float32"),
}


def register_hf_model(name: str, constructor: Callable, kwargs: dict | None = None, dtype: str = "float32") -> None:
    """Let a test module add its own tiny model kind to the session fixture."""
    HF_MODELS[name] = (constructor, kwargs or {}, dtype)


def randomize_(model, seed: int = 0) -> None:
    """Give every parameter (norms and biases too) random values so no mapping error hides behind
    ones/zeros."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32).to(p.dtype) * 0.1)


def save_tiny_hf_model(name: str, path: Path, max_shard_size: str = "60KB"):
    """Save a tiny random model of kind ``name`` in several shards; returns ``(path, torch model)``."""
    import torch

    constructor, kwargs, dtype = HF_MODELS[name]
    torch.manual_seed(0)
    model = constructor(**kwargs)
    randomize_(model)
    model = model.to(getattr(torch, dtype)).eval()
    model.save_pretrained(path, max_shard_size=max_shard_size)
    return Path(path), model


def token_ids(batch: int = 2, seq: int = 12, vocab: int = 256, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq))


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    """transformers' logits in float32 (the reference)."""
    import torch

    with torch.no_grad():
        return model(torch.tensor(ids)).logits.float().numpy()


def max_rel_diff(ours: np.ndarray, ref: np.ndarray) -> float:
    """max |ours - ref| / max |ref| — the parity measure of the quality bar (≤ 1e-4 for f32)."""
    ours = np.asarray(ours, np.float32)
    return float(np.abs(ours - ref).max() / np.abs(ref).max())


@functools.cache
def jitted_forward():
    """``jax.jit(lambda m, x: m(x))``, one for the session (see :func:`jax_logits`)."""
    import jax

    return jax.jit(lambda m, x: m(x))


def jax_logits(model, ids: np.ndarray) -> np.ndarray:
    """otfload's logits under ``jax.jit``: one jitted function for the session, so that a model of the same
    structure, shapes and shardings (a kind another test loaded already) reuses its compiled program."""
    import jax.numpy as jnp

    return np.asarray(jitted_forward()(model, jnp.asarray(ids)))


def hf_tensors(path: Path) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint directory, read with the ``safetensors`` package (the reference)."""
    from safetensors.numpy import load_file

    return {k: v for f in sorted(Path(path).glob("*.safetensors")) for k, v in load_file(f).items()}


def evict(path: Path) -> None:
    """Drop ``path``'s pages from the page cache (flushed first: only clean pages can be dropped)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def memory_copy(local: Path, name: str = "ckpt") -> str:
    """A ``memory://`` URL (fsspec's in-memory store: a remote source, read by ranges) holding a copy
    of the files of ``local``."""
    import uuid

    import fsspec

    url = f"memory://{name}-{uuid.uuid4().hex}"
    fs = fsspec.filesystem("memory")
    for p in local.iterdir():
        fs.pipe_file(f"{url}/{p.name}", p.read_bytes())
    return url


def module_name(key: str) -> str:
    """A Hub key of a multimodal checkpoint (``language_model.model.*``) as transformers names the
    module in memory (``model.language_model.*``; vision tower and projector under ``model.``)."""
    if key.startswith("language_model.lm_head."):
        return key[len("language_model."):]
    if key.startswith("language_model.model."):
        return "model.language_model." + key[len("language_model.model."):]
    return "model." + key


def rename_tensors(path: Path, rename: Callable[[str], str], extra: dict[str, np.ndarray] | None = None) -> None:
    """Rename every tensor of the (sharded, float) checkpoint at ``path`` in place, adding ``extra``
    to its first shard."""
    import json

    from safetensors.numpy import load_file, save_file

    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shards = sorted(set(index["weight_map"].values()))
    for shard in shards:
        tensors = {rename(k): v for k, v in load_file(path / shard).items()}
        if shard == shards[0]:
            tensors.update(extra or {})
        save_file(tensors, path / shard, metadata={"format": "pt"})
    weight_map = {rename(k): f for k, f in index["weight_map"].items()}
    weight_map.update(dict.fromkeys(extra or {}, shards[0]))
    index_file.write_text(json.dumps({**index, "weight_map": weight_map}))
