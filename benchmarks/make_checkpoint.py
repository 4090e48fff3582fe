"""Write a synthetic Llama- or Mixtral-shaped bf16 HF checkpoint of a requested size (no torch).

    python -m benchmarks.make_checkpoint --size-gib 1.0 [--moe] [--out bench_data/llama-1.0g]

Tensors follow the Hub layout (``model.layers.{i}.self_attn.q_proj.weight`` [out, in], Mixtral's
``block_sparse_moe.experts.{e}.w1.weight``), are split into shards of at most ``--shard-mb`` with
``model.safetensors.index.json``, and hold random bf16 values of a plausible magnitude, generated
from random bits (fast: ~1 GB/s) rather than a per-element normal sampler.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

DEFAULT_ROOT = Path("bench_data")
HEAD_DIM = 128
KV_HEADS = 4
VOCAB = 32000
EXPERTS = 8
MIN_LAYERS = 16
BF16_ONE = 0x3F80


@dataclass(frozen=True)
class Dims:
    """Shape of a synthetic checkpoint; ``experts > 0`` makes it Mixtral-shaped, ``qk_norm`` gives each
    layer Qwen3's query and key norms. ``heads`` (default ``hidden // head_dim``) times ``head_dim``
    need not be ``hidden``."""

    hidden: int
    intermediate: int
    layers: int
    experts: int = 0
    vocab: int = VOCAB
    heads: int = 0
    kv_heads: int = KV_HEADS
    head_dim: int = HEAD_DIM
    qk_norm: bool = False

    def __post_init__(self) -> None:
        if not self.heads:
            object.__setattr__(self, "heads", self.hidden // self.head_dim)

    def tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        """Every tensor's HF name and shape (``[out, in]`` projections), in file order."""
        h, i, q, kv = self.hidden, self.intermediate, self.heads * self.head_dim, self.kv_heads * self.head_dim
        out = [("model.embed_tokens.weight", (self.vocab, h))]
        for n in range(self.layers):
            p = f"model.layers.{n}"
            out += [
                (f"{p}.input_layernorm.weight", (h,)),
                (f"{p}.self_attn.q_proj.weight", (q, h)),
                (f"{p}.self_attn.k_proj.weight", (kv, h)),
                (f"{p}.self_attn.v_proj.weight", (kv, h)),
                (f"{p}.self_attn.o_proj.weight", (h, q)),
            ]
            if self.qk_norm:
                out += [(f"{p}.self_attn.q_norm.weight", (self.head_dim,)),
                        (f"{p}.self_attn.k_norm.weight", (self.head_dim,))]  # fmt: skip
            out.append((f"{p}.post_attention_layernorm.weight", (h,)))
            if self.experts:
                moe = f"{p}.block_sparse_moe"
                out.append((f"{moe}.gate.weight", (self.experts, h)))
                for e in range(self.experts):
                    out += [
                        (f"{moe}.experts.{e}.w1.weight", (i, h)),
                        (f"{moe}.experts.{e}.w2.weight", (h, i)),
                        (f"{moe}.experts.{e}.w3.weight", (i, h)),
                    ]
            else:
                out += [
                    (f"{p}.mlp.gate_proj.weight", (i, h)),
                    (f"{p}.mlp.up_proj.weight", (i, h)),
                    (f"{p}.mlp.down_proj.weight", (h, i)),
                ]
        out += [("model.norm.weight", (h,)), ("lm_head.weight", (self.vocab, h))]
        return out

    @property
    def nbytes(self) -> int:
        return sum(2 * math.prod(shape) for _, shape in self.tensors())

    def config(self) -> dict:
        """A ``config.json`` transformers would accept for this shape."""
        cfg = {
            "architectures": ["MixtralForCausalLM" if self.experts else "LlamaForCausalLM"],
            "model_type": "mixtral" if self.experts else "llama",
            "vocab_size": self.vocab,
            "hidden_size": self.hidden,
            "intermediate_size": self.intermediate,
            "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads,
            "num_key_value_heads": self.kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "hidden_act": "silu",
            "tie_word_embeddings": False,
            "torch_dtype": "bfloat16",
        }
        if self.experts:
            cfg.update(num_local_experts=self.experts, num_experts_per_tok=2, sliding_window=None)
        return cfg


def _per_layer_bytes(hidden: int, intermediate: int, experts: int) -> int:
    return Dims(hidden, intermediate, 1, experts).nbytes - Dims(hidden, intermediate, 0, experts).nbytes


def choose_dims(size_bytes: int, moe: bool = False) -> Dims:
    """The widest shape (hidden a multiple of 512, so heads divide tp=4) with ≥ 16 layers and ≥ ``size_bytes``."""
    best = None
    for hidden in range(512, 8193, 512):
        intermediate = hidden if moe else round(2.75 * hidden / 128) * 128
        experts = EXPERTS if moe else 0
        base = Dims(hidden, intermediate, 0, experts).nbytes
        layers = math.ceil((size_bytes - base) / _per_layer_bytes(hidden, intermediate, experts))
        if layers >= MIN_LAYERS or best is None:
            best = Dims(hidden, intermediate, max(layers, 1), experts)
        if layers < MIN_LAYERS:
            break
    return best


def random_bf16(shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """Random bf16 values of magnitude 2^-10 .. 2^-3 with random sign and mantissa, from raw bits."""
    n = math.prod(shape)
    bits = np.frombuffer(rng.bytes(2 * n), np.uint16).copy()
    exponent = 117 + ((bits >> 8) & 7)  # biased exponents 117..124
    bits &= 0x807F  # keep sign and mantissa
    bits |= (exponent << 7).astype(np.uint16)
    return bits.view(ml_dtypes.bfloat16).reshape(shape)


def _tensor(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("norm.weight"):
        return np.full(shape, BF16_ONE, np.uint16).view(ml_dtypes.bfloat16)
    return random_bf16(shape, rng)


Values = Callable[[str, tuple[int, ...], np.random.Generator], np.ndarray]


def write_checkpoint(
    out: Path, dims: Dims, *, config: dict | None = None, values: Values = _tensor, shard_bytes: int = 500 * 10**6,
    seed: int = 0,
) -> Path:
    """``dims``' tensors with ``values(name, shape, rng)`` as ``model-0000k-of-0000n.safetensors`` shards
    of at most ``shard_bytes``, their index and ``config`` (default ``dims.config()``; written last: it
    marks the checkpoint complete) into ``out``; returns ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("*.safetensors"), *out.glob("*.json")]:
        old.unlink()
    tensors = dims.tensors()
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in tensors:
        nbytes = 2 * math.prod(shape)
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    rng = np.random.default_rng(seed)
    weight_map = {}
    for k, members in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({name: values(name, shape, rng) for name, shape in members}, out / file, metadata={"format": "pt"})
        weight_map.update({name: file for name, _ in members})
    index = {"metadata": {"total_size": dims.nbytes}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(config or dims.config(), indent=1))
    return out


def ensure_written(out: Path, dims: Dims, **options: Any) -> Path:
    """``out`` as :func:`write_checkpoint` writes it (same ``options``), written first unless its
    ``config.json`` is already the one expected."""
    config = options.get("config") or dims.config()
    marker = out / "config.json"
    if not (marker.exists() and json.loads(marker.read_text()) == config):
        write_checkpoint(out, dims, **options)
    return out


def default_dir(size_gib: float, moe: bool) -> Path:
    return DEFAULT_ROOT / f"{'mixtral' if moe else 'llama'}-{size_gib:g}g"


def ensure_checkpoint(size_gib: float, moe: bool = False, out: Path | None = None) -> Path:
    """The checkpoint directory for this size, written first if it is missing or of another shape."""
    return ensure_written(default_dir(size_gib, moe) if out is None else out, choose_dims(int(size_gib * 2**30), moe))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--moe", action="store_true", help="Mixtral-shaped (8 experts) instead of Llama-shaped")
    parser.add_argument("--out", type=Path, default=None, help="default: bench_data/{llama,mixtral}-<size>g")
    parser.add_argument("--shard-mb", type=int, default=500)
    args = parser.parse_args(argv)
    dims = choose_dims(int(args.size_gib * 2**30), args.moe)
    out = write_checkpoint(args.out or default_dir(args.size_gib, args.moe), dims, shard_bytes=args.shard_mb * 10**6)
    print(f"{out}: {dims} = {dims.nbytes / 2**30:.3f} GiB in {len(list(out.glob('*.safetensors')))} files")


if __name__ == "__main__":
    main()
