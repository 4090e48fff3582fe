"""Sparse replicas of real checkpoints: the real safetensors headers, holes for the tensor bytes.

    python scripts/make_replica.py deepseek-v3 /tmp/replicas/deepseek-v3
    python scripts/make_replica.py --list

A replica has the published model's ``config.json``, its tensor names, dtypes and shapes, split over
as many shard files as the published checkpoint (with ``model.safetensors.index.json``); each shard
is a real safetensors header followed by a hole made with ``truncate`` — a 671B model costs a few MB
of disk. Planning and ``otfload inspect`` read headers and config only, so they run at real size; any
tensor read returns zeros.

Models (from their published ``config.json`` and tensor layout):

* ``deepseek-v3``: DeepSeek-V3 671B, FP8 e4m3 weights with 128×128 ``weight_scale_inv`` blocks,
  61 layers (3 dense) + the MTP layer 61, 256 routed experts, 163 shards;
* ``llama-3.1-405b``: Llama-3.1-405B, bf16, 126 layers, 191 shards;
* ``qwen3-235b-a22b``: Qwen3-235B-A22B, bf16, 94 layers × 128 experts, 118 shards;
* ``gpt-oss-120b``: GPT-OSS-120B, MXFP4 experts (``_blocks``/``_scales``), bf16 elsewhere, 15 shards;
* ``deepseek-v3.2``, ``glm-5``: from their published ``config.json`` (``--config``): DeepSeek-V3.2
  as DeepSeek-V3 (FP8) plus each layer's DSA indexer (``self_attn.indexer.*``: ``wq_b``/``wk`` FP8,
  ``k_norm`` and ``weights_proj`` BF16); GLM-5 the same layout in BF16;
* ``kimi-k2.5``: Kimi-K2.5 from its published ``config.json`` (``--config``, e.g.
  ``../shared/realconfigs/moonshotai__Kimi-K2.5.json``): the DeepSeek-V3 text model under
  ``language_model.``, int4 ``pack-quantized`` routed experts, bf16 elsewhere, a stand-in vision
  tower; 64 shards.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import struct
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

Tensor = tuple[str, str, tuple[int, ...]]  # name, safetensors dtype, shape
# The few tensors otfload reads while planning (compressed-tensors' ``weight_shape``) by name: their
# bytes are written; every other tensor is a hole.
Values = dict[str, bytes]
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "U8": 1, "I8": 1, "I32": 4, "I64": 8}
# safetensors pads its JSON header with spaces to a multiple of this many bytes.
HEADER_ALIGN = 8


@dataclass(frozen=True)
class Replica:
    """A published model: its config, a generator of its tensors in file order, its shard count, and
    the values of the tensors planning reads."""

    config: dict
    tensors: Callable[[dict], Iterator[Tensor]]
    shards: int
    values: Callable[[dict], Values] | None = None


# --- DeepSeek-V3 (deepseek-ai/DeepSeek-V3) ----------------------------------------------------------

DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1, "num_attention_heads": 128, "num_key_value_heads": 128, "n_shared_experts": 1,
    "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "topk_method": "noaux_tc", "n_group": 8,
    "topk_group": 4, "num_experts_per_tok": 8, "moe_layer_freq": 1, "first_k_dense_replace": 3,
    "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu", "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06, "rope_theta": 10000, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
}  # fmt: skip
FP8_BLOCK = 128


Linear = Callable[[str, tuple[int, int]], Iterator[Tensor]]  # a linear module's tensors by its name and shape


def _fp8(name: str, shape: tuple[int, int]) -> Iterator[Tensor]:
    yield f"{name}.weight", "F8_E4M3", shape
    yield f"{name}.weight_scale_inv", "F32", (-(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK))


def deepseek_v3_tensors(c: dict, linear: Linear = _fp8, expert: Linear = _fp8, prefix: str = "") -> Iterator[Tensor]:
    """DeepSeek-V3's tensors; ``linear`` / ``expert`` give a linear module's / a routed expert's."""
    h, heads = c["hidden_size"], c["num_attention_heads"]
    qk = c["qk_nope_head_dim"] + c["qk_rope_head_dim"]
    yield f"{prefix}model.embed_tokens.weight", "BF16", (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"] + c["num_nextn_predict_layers"]):
        p = f"{prefix}model.layers.{n}"
        yield f"{p}.input_layernorm.weight", "BF16", (h,)
        yield f"{p}.post_attention_layernorm.weight", "BF16", (h,)
        a = f"{p}.self_attn"
        yield from linear(f"{a}.q_a_proj", (c["q_lora_rank"], h))
        yield f"{a}.q_a_layernorm.weight", "BF16", (c["q_lora_rank"],)
        yield from linear(f"{a}.q_b_proj", (heads * qk, c["q_lora_rank"]))
        yield from linear(f"{a}.kv_a_proj_with_mqa", (c["kv_lora_rank"] + c["qk_rope_head_dim"], h))
        yield f"{a}.kv_a_layernorm.weight", "BF16", (c["kv_lora_rank"],)
        yield from linear(f"{a}.kv_b_proj", (heads * (c["qk_nope_head_dim"] + c["v_head_dim"]), c["kv_lora_rank"]))
        yield from linear(f"{a}.o_proj", (h, heads * c["v_head_dim"]))
        if "index_topk" in c:  # DeepSeek-V3.2 / GLM-5: the DSA indexer (its norm and head weights unquantized)
            i, d = f"{a}.indexer", c["index_head_dim"]
            yield from linear(f"{i}.wq_b", (c["index_n_heads"] * d, c["q_lora_rank"]))
            yield from linear(f"{i}.wk", (d, h))
            yield f"{i}.k_norm.weight", "BF16", (d,)
            yield f"{i}.k_norm.bias", "BF16", (d,)
            yield f"{i}.weights_proj.weight", "BF16", (c["index_n_heads"], h)
        if n < c["first_k_dense_replace"]:
            i = c["intermediate_size"]
            yield from linear(f"{p}.mlp.gate_proj", (i, h))
            yield from linear(f"{p}.mlp.up_proj", (i, h))
            yield from linear(f"{p}.mlp.down_proj", (h, i))
        else:
            i, e = c["moe_intermediate_size"], c["n_routed_experts"]
            yield f"{p}.mlp.gate.weight", "BF16", (e, h)
            yield f"{p}.mlp.gate.e_score_correction_bias", "F32", (e,)
            for x in range(e):
                yield from expert(f"{p}.mlp.experts.{x}.gate_proj", (i, h))
                yield from expert(f"{p}.mlp.experts.{x}.up_proj", (i, h))
                yield from expert(f"{p}.mlp.experts.{x}.down_proj", (h, i))
            shared = i * c["n_shared_experts"]
            yield from linear(f"{p}.mlp.shared_experts.gate_proj", (shared, h))
            yield from linear(f"{p}.mlp.shared_experts.up_proj", (shared, h))
            yield from linear(f"{p}.mlp.shared_experts.down_proj", (h, shared))
        if n >= c["num_hidden_layers"]:  # the MTP layer's own modules
            yield f"{p}.embed_tokens.weight", "BF16", (c["vocab_size"], h)
            yield f"{p}.enorm.weight", "BF16", (h,)
            yield f"{p}.hnorm.weight", "BF16", (h,)
            yield f"{p}.eh_proj.weight", "BF16", (h, 2 * h)
            yield f"{p}.shared_head.norm.weight", "BF16", (h,)
            yield f"{p}.shared_head.head.weight", "BF16", (c["vocab_size"], h)
    yield f"{prefix}model.norm.weight", "BF16", (h,)
    yield f"{prefix}lm_head.weight", "BF16", (c["vocab_size"], h)


# --- Llama-3.1-405B (meta-llama/Llama-3.1-405B) ------------------------------------------------------

LLAMA_405B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 16384,
    "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
    "head_dim": 128, "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
}  # fmt: skip


def llama_tensors(c: dict) -> Iterator[Tensor]:
    h, i = c["hidden_size"], c["intermediate_size"]
    kv = c["num_key_value_heads"] * c["head_dim"]
    q = c["num_attention_heads"] * c["head_dim"]
    yield "model.embed_tokens.weight", "BF16", (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}"
        yield f"{p}.input_layernorm.weight", "BF16", (h,)
        yield f"{p}.self_attn.q_proj.weight", "BF16", (q, h)
        yield f"{p}.self_attn.k_proj.weight", "BF16", (kv, h)
        yield f"{p}.self_attn.v_proj.weight", "BF16", (kv, h)
        yield f"{p}.self_attn.o_proj.weight", "BF16", (h, q)
        yield f"{p}.post_attention_layernorm.weight", "BF16", (h,)
        yield f"{p}.mlp.gate_proj.weight", "BF16", (i, h)
        yield f"{p}.mlp.up_proj.weight", "BF16", (i, h)
        yield f"{p}.mlp.down_proj.weight", "BF16", (h, i)
    yield "model.norm.weight", "BF16", (h,)
    yield "lm_head.weight", "BF16", (c["vocab_size"], h)


# --- Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B) ----------------------------------------------------------

QWEN3_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "hidden_act": "silu",
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "attention_bias": False,
    "tie_word_embeddings": False, "use_sliding_window": False, "torch_dtype": "bfloat16",
}  # fmt: skip


def qwen3_moe_tensors(c: dict) -> Iterator[Tensor]:
    h, d = c["hidden_size"], c["head_dim"]
    q, kv, i = c["num_attention_heads"] * d, c["num_key_value_heads"] * d, c["moe_intermediate_size"]
    yield "model.embed_tokens.weight", "BF16", (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}"
        yield f"{p}.input_layernorm.weight", "BF16", (h,)
        yield f"{p}.self_attn.q_proj.weight", "BF16", (q, h)
        yield f"{p}.self_attn.k_proj.weight", "BF16", (kv, h)
        yield f"{p}.self_attn.v_proj.weight", "BF16", (kv, h)
        yield f"{p}.self_attn.o_proj.weight", "BF16", (h, q)
        yield f"{p}.self_attn.q_norm.weight", "BF16", (d,)
        yield f"{p}.self_attn.k_norm.weight", "BF16", (d,)
        yield f"{p}.post_attention_layernorm.weight", "BF16", (h,)
        yield f"{p}.mlp.gate.weight", "BF16", (c["num_experts"], h)
        for x in range(c["num_experts"]):
            yield f"{p}.mlp.experts.{x}.gate_proj.weight", "BF16", (i, h)
            yield f"{p}.mlp.experts.{x}.up_proj.weight", "BF16", (i, h)
            yield f"{p}.mlp.experts.{x}.down_proj.weight", "BF16", (h, i)
    yield "model.norm.weight", "BF16", (h,)
    yield "lm_head.weight", "BF16", (c["vocab_size"], h)


# --- GPT-OSS-120B (openai/gpt-oss-120b) --------------------------------------------------------------

GPT_OSS_120B = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "vocab_size": 201088, "hidden_size": 2880,
    "intermediate_size": 2880, "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
    "head_dim": 64, "num_local_experts": 128, "num_experts_per_tok": 4, "experts_per_token": 4,
    "sliding_window": 128, "layer_types": ["sliding_attention", "full_attention"] * 18, "hidden_act": "silu",
    "max_position_embeddings": 131072, "rms_norm_eps": 1e-05, "rope_theta": 150000, "attention_bias": True,
    "swiglu_limit": 7.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}  # fmt: skip
MXFP4_BLOCK = 32  # values per scale; two 4-bit codes per byte


def gpt_oss_tensors(c: dict) -> Iterator[Tensor]:
    h, d, e, i = c["hidden_size"], c["head_dim"], c["num_local_experts"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    yield "model.embed_tokens.weight", "BF16", (c["vocab_size"], h)
    for n in range(c["num_hidden_layers"]):
        p = f"model.layers.{n}"
        yield f"{p}.input_layernorm.weight", "BF16", (h,)
        yield f"{p}.post_attention_layernorm.weight", "BF16", (h,)
        a = f"{p}.self_attn"
        for name, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            yield f"{a}.{name}.weight", "BF16", (rows, h)
            yield f"{a}.{name}.bias", "BF16", (rows,)
        yield f"{a}.o_proj.weight", "BF16", (h, q)
        yield f"{a}.o_proj.bias", "BF16", (h,)
        yield f"{a}.sinks", "BF16", (c["num_attention_heads"],)
        yield f"{p}.mlp.router.weight", "BF16", (e, h)
        yield f"{p}.mlp.router.bias", "BF16", (e,)
        x = f"{p}.mlp.experts"
        for name, out, inner in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            yield f"{x}.{name}_blocks", "U8", (e, out, inner // MXFP4_BLOCK, MXFP4_BLOCK // 2)
            yield f"{x}.{name}_scales", "U8", (e, out, inner // MXFP4_BLOCK)
            yield f"{x}.{name}_bias", "BF16", (e, out)
    yield "model.norm.weight", "BF16", (h,)
    yield "lm_head.weight", "BF16", (c["vocab_size"], h)


# --- Kimi-K2.5 (moonshotai/Kimi-K2.5): its published config.json is passed in (--config) -------------

INT4_GROUP = 32  # Kimi-K2.5's routed experts: int4 in groups of 32 (text_config.quantization_config)
INT4_PER_WORD = 8


def _bf16(name: str, shape: tuple[int, int]) -> Iterator[Tensor]:
    yield f"{name}.weight", "BF16", shape


def _int4(name: str, shape: tuple[int, int]) -> Iterator[Tensor]:
    """compressed-tensors pack-quantized: 8 int4 per I32 along the input, BF16 scales per group."""
    yield f"{name}.weight_packed", "I32", (shape[0], shape[1] // INT4_PER_WORD)
    yield f"{name}.weight_scale", "BF16", (shape[0], shape[1] // INT4_GROUP)
    yield f"{name}.weight_shape", "I64", (2,)


def kimi_k25_tensors(c: dict) -> Iterator[Tensor]:
    """The text model (``text_config``) under ``language_model.``: BF16 but for the int4 routed
    experts; then a stand-in vision tower and projector (never read by otfload)."""
    yield from deepseek_v3_tensors({"num_nextn_predict_layers": 0, **c["text_config"]}, _bf16, _int4,
                                   "language_model.")
    vision = c.get("vision_config", {}).get("hidden_size", 1152)
    yield "vision_tower.patch_embed.proj.weight", "BF16", (vision, 3, 14, 14)
    yield "mm_projector.proj.0.weight", "BF16", (c["text_config"]["hidden_size"], vision * 4)


def kimi_k25_values(c: dict) -> Values:
    """Every routed expert's ``weight_shape``: ``[out, in]`` as int64."""
    t = c["text_config"]
    up = struct.pack("<2q", t["moe_intermediate_size"], t["hidden_size"])
    down = struct.pack("<2q", t["hidden_size"], t["moe_intermediate_size"])
    return {f"language_model.model.layers.{n}.mlp.experts.{x}.{name}.weight_shape": down if name == "down_proj" else up
            for n in range(t["first_k_dense_replace"], t["num_hidden_layers"]) for x in range(t["n_routed_experts"])
            for name in ("gate_proj", "up_proj", "down_proj")}


def glm5_tensors(c: dict) -> Iterator[Tensor]:
    """GLM-5 (``glm_moe_dsa``, bf16 as its config says): DeepSeek-V3.2's layout in BF16."""
    yield from deepseek_v3_tensors(c, _bf16, _bf16)


REPLICAS = {
    "deepseek-v3": Replica(DEEPSEEK_V3, deepseek_v3_tensors, 163),
    # From their published config.json (--config): DeepSeek-V3.2 FP8 as DeepSeek-V3 plus the indexer;
    # GLM-5 in BF16 (its shard count is not recorded here: ~5 GB shards).
    "deepseek-v3.2": Replica({}, deepseek_v3_tensors, 163),
    "glm-5": Replica({}, glm5_tensors, 282),
    "kimi-k2.5": Replica({}, kimi_k25_tensors, 64, kimi_k25_values),
    "llama-3.1-405b": Replica(LLAMA_405B, llama_tensors, 191),
    "qwen3-235b-a22b": Replica(QWEN3_235B, qwen3_moe_tensors, 118),
    "gpt-oss-120b": Replica(GPT_OSS_120B, gpt_oss_tensors, 15),
}


def nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return ITEMSIZE[dtype] * math.prod(shape)


def write_shard(path: Path, tensors: list[Tensor], values: Values | None = None) -> None:
    """A safetensors file: the real header, then a hole of the tensors' size (no data written but
    ``values``)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    if values:  # the valued tensors first: their bytes share a few pages instead of one page each
        tensors = sorted(tensors, key=lambda t: t[0] not in values)
    for name, dtype, shape in tensors:
        size = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % HEADER_ALIGN)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        f.truncate(8 + len(text) + offset)  # a hole: reads give zeros, the disk holds nothing
        for name, *_ in tensors:
            if values and name in values:
                f.seek(8 + len(text) + header[name]["data_offsets"][0])
                f.write(values[name])


def make_replica(name: str, out: Path, config: dict | None = None) -> dict:
    """Write replica ``name`` into ``out`` (from ``config``, the published ``config.json``, for the
    replicas that take it); returns a summary (tensors, bytes, files)."""
    replica = REPLICAS[name]
    config = config or replica.config
    if not config:
        raise SystemExit(f"{name}: pass its published config.json (--config)")
    tensors = list(replica.tensors(config))
    values = replica.values(config) if replica.values else None
    total = sum(nbytes(d, s) for _, d, s in tensors)
    target = total / replica.shards
    shards: list[list[Tensor]] = [[]]
    filled = 0.0
    for tensor in tensors:  # consecutive tensors, each shard up to its share of the bytes
        if filled >= target * len(shards) and len(shards) < replica.shards:
            shards.append([])
        shards[-1].append(tensor)
        filled += nbytes(tensor[1], tensor[2])
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for k, group in enumerate(shards):
        file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        write_shard(out / file, group, values)
        weight_map.update(dict.fromkeys((t[0] for t in group), file))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return {"model": name, "tensors": len(tensors), "bytes": total, "files": len(shards)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", choices=sorted(REPLICAS))
    parser.add_argument("out", nargs="?", type=Path)
    parser.add_argument("--list", action="store_true", help="list the models")
    parser.add_argument("--config", type=Path, help="the published config.json (kimi-k2.5 takes it from here)")
    args = parser.parse_args(argv)
    if args.list or args.model is None or args.out is None:
        print("\n".join(sorted(REPLICAS)))
        return 0 if args.list else 2
    info = make_replica(args.model, args.out, json.loads(args.config.read_text()) if args.config else None)
    disk = sum(os.stat(p).st_blocks * 512 for p in args.out.iterdir())
    print(f"{args.out}: {info['tensors']} tensors, {info['bytes'] / 1e9:.1f} GB in {info['files']} files "
          f"({disk / 1e6:.1f} MB on disk)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
