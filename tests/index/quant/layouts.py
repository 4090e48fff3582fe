"""Tiny checkpoints in each published quantized layout, made from a float checkpoint, with the
reference dequantised value of every quantized parameter.

Where a real writer exists on this machine it writes the bytes: compressed-tensors' own compressors
(``FloatQuantizationCompressor``, ``PackedQuantizationCompressor``, ``NVFP4PackedCompressor``) pack
the codes and their ``decompress`` gives the reference (fed float32 scales, so the reference is
exact rather than rounded to bf16). MXFP4 codes are written here from the OCP format description and
dequantised for reference by transformers' own ``convert_moe_packed_tensors``; FP8 layouts are
written and dequantised in numpy from their format descriptions.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

Quantizer = Callable[[str, torch.Tensor], tuple[dict[str, torch.Tensor], torch.Tensor]]
FP8_MAX = 448.0  # largest float8_e4m3fn value
E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


class SideFile(dict):
    """A quantization config written as its own JSON file beside ``config.json`` (ModelOpt's
    ``hf_quant_config.json``) instead of as ``config.json``'s ``quantization_config``."""

    name = "hf_quant_config.json"


def quantize_checkpoint(src: Path, dst: Path, select: Callable[[str], bool], quantize: Quantizer,
                        quantization_config: dict | None) -> dict[str, np.ndarray]:
    """Copy ``src`` to ``dst`` with every tensor ``select`` picks replaced by ``quantize``'s stored
    tensors; returns {HF key: reference float32 value} of the quantized ones."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    reference = {}
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = load_file(shard)
        for key in [k for k in tensors if select(k)]:
            stored, ref = quantize(key, tensors.pop(key).float())
            index["weight_map"].pop(key)
            for name, value in stored.items():
                tensors[name] = value.contiguous()
                index["weight_map"][name] = shard.name
            reference[key] = ref.float().contiguous().numpy()
        save_file(tensors, shard, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))
    config = json.loads((dst / "config.json").read_text())
    if isinstance(quantization_config, SideFile):
        (dst / quantization_config.name).write_text(json.dumps(quantization_config))
    elif quantization_config is not None:
        config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return reference


def is_linear(key: str) -> bool:
    return key.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")) and "lm_head" not in key


# --- FP8 (numpy reference from the format description) ------------------------------------------


def fp8_blocks(block: tuple[int, int] | None, suffix: str = "_scale_inv", scale_dtype=torch.float32,
               per_row: bool = False) -> Quantizer:
    """FP8 e4m3 codes with one scale per ``block`` (None: per tensor, a 0-d scale; ``per_row``)."""

    def quantize(key: str, w: torch.Tensor):
        rows, cols = w.shape
        b0, b1 = (1, cols) if per_row else (rows, cols) if block is None else block
        grid = (-(-rows // b0), -(-cols // b1))
        padded = torch.zeros(grid[0] * b0, grid[1] * b1)
        padded[:rows, :cols] = w
        amax = padded.reshape(grid[0], b0, grid[1], b1).abs().amax((1, 3)).clamp_min(1e-12)
        scale = (amax / FP8_MAX).to(scale_dtype)
        full = scale.float().repeat_interleave(b0, 0).repeat_interleave(b1, 1)[:rows, :cols]
        codes = (w / full).to(torch.float8_e4m3fn)
        stored_scale = scale.reshape(()) if block is None and not per_row else scale
        return {key: codes, f"{key}{suffix}": stored_scale}, codes.float() * full

    return quantize


# --- compressed-tensors (its own compressors write and decompress) ------------------------------


def ct_weights(kind: str) -> dict:
    """The ``weights`` quantization args of a named compressed-tensors scheme."""
    return {
        "fp8_tensor": {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True},
        "fp8_channel": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True},
        "fp8_block": {"num_bits": 8, "type": "float", "strategy": "block", "block_structure": [48, 48],
                      "symmetric": True},
        "w4a16": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True},
        "w4a16_asym": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False},
        "w8a16_channel": {"num_bits": 8, "type": "int", "strategy": "channel", "symmetric": True},
        "nvfp4": {"num_bits": 4, "type": "float", "strategy": "tensor_group", "group_size": 16, "symmetric": True},
    }[kind]


CT_FORMATS = {"fp8_tensor": "float-quantized", "fp8_channel": "float-quantized", "fp8_block": "float-quantized",
              "w4a16": "pack-quantized", "w4a16_asym": "pack-quantized", "w8a16_channel": "pack-quantized",
              "nvfp4": "nvfp4-pack-quantized"}


def ct_config(kind: str, ignore: list[str] | None = None) -> dict:
    return {
        "quant_method": "compressed-tensors",
        "format": CT_FORMATS[kind],
        "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": ct_weights(kind)}},
        "ignore": ignore if ignore is not None else ["lm_head"],
    }


def _ct_qparams(w: torch.Tensor, weights: dict) -> dict[str, torch.Tensor]:
    """Scales (bf16, or f32 for FP8) and zero points for ``w`` under ``weights``."""
    rows, cols = w.shape
    strategy, bits = weights["strategy"], weights["num_bits"]
    if strategy == "tensor":
        groups = w.reshape(1, 1, -1)
    elif strategy == "channel":
        groups = w.reshape(rows, 1, cols)
    elif strategy == "block":
        b0, b1 = weights["block_structure"]
        grid = (-(-rows // b0), -(-cols // b1))
        padded = torch.zeros(grid[0] * b0, grid[1] * b1)
        padded[:rows, :cols] = w
        groups = padded.reshape(grid[0], b0, grid[1], b1).permute(0, 2, 1, 3).reshape(grid[0], grid[1], -1)
    else:
        groups = w.reshape(rows, cols // weights["group_size"], weights["group_size"])
    if weights["type"] == "float" and bits == 8:
        return {"weight_scale": (groups.abs().amax(-1) / FP8_MAX).clamp_min(1e-12).reshape(
            (1,) if strategy == "tensor" else groups.shape[:2])}
    if weights["type"] == "float":  # NVFP4: FP8 scales under a global scale
        global_scale = FP8_MAX * 6.0 / w.abs().max().reshape(1)
        scale = (groups.abs().amax(-1) / 6.0 * global_scale).to(torch.float8_e4m3fn).float()
        return {"weight_scale": scale, "weight_global_scale": global_scale}
    qmax = 2 ** (bits - 1) - 1
    if weights["symmetric"]:
        return {"weight_scale": (groups.abs().amax(-1) / qmax).clamp_min(1e-6).to(torch.bfloat16).reshape(
            groups.shape[:2])}
    lo, hi = groups.amin(-1).clamp_max(0), groups.amax(-1).clamp_min(0)
    scale = ((hi - lo) / (2 * qmax + 1)).clamp_min(1e-6).to(torch.bfloat16)
    zero = (-(2 ** (bits - 1)) - torch.round(lo / scale.float())).clamp(-(2 ** (bits - 1)), qmax).to(torch.int8)
    return {"weight_scale": scale, "weight_zero_point": zero}


def compressed_tensors(kind: str) -> Quantizer:
    """A quantizer writing ``kind`` with compressed-tensors' own compressor."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    weights = ct_weights(kind)
    scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(**weights))
    compressor = {"float-quantized": FloatQuantizationCompressor, "pack-quantized": PackedQuantizationCompressor,
                  "nvfp4-pack-quantized": NVFP4PackedCompressor}[CT_FORMATS[kind]]

    def quantize(key: str, w: torch.Tensor):
        module = key[: -len(".weight")]
        stored = compressor.compress({"weight": w, **_ct_qparams(w, weights)}, scheme)
        if CT_FORMATS[kind] == "nvfp4-pack-quantized":  # its decompress rounds to bf16: redo it in f32
            from compressed_tensors.compressors.nvfp4.helpers import unpack_fp4_from_uint8

            packed = stored["weight_packed"]
            values = unpack_fp4_from_uint8(packed, packed.shape[0], packed.shape[1] * 2, dtype=torch.float32)
            scale = stored["weight_scale"].float() / stored["weight_global_scale"]
            reference = values * scale.repeat_interleave(weights["group_size"], 1)
        else:
            exact = {k: v.float() if k == "weight_scale" else v for k, v in stored.items()}
            reference = compressor.decompress(exact, scheme)["weight"]
        return {f"{module}.{k}": v for k, v in stored.items()}, reference

    return quantize


# --- MXFP4 (GPT-OSS): written from the OCP description, dequantised by transformers ---------------


def e2m1_codes(scaled: torch.Tensor) -> torch.Tensor:
    """The nearest FP4 E2M1 code (sign in bit 3) of each value, as int64."""
    return (scaled.abs()[..., None] - E2M1).abs().argmin(-1) | (scaled < 0).to(torch.int64) << 3


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Two 4-bit codes per byte along the last axis, the low nibble first."""
    codes = codes.to(torch.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).contiguous()


def mxfp4_pack(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` [..., in, out] as GPT-OSS stores it: blocks U8 [..., out, in/32, 16], scales U8 E8M0."""
    t = w.transpose(-1, -2).contiguous()  # [..., out, in]
    *lead, out, cols = t.shape
    groups = t.reshape(*lead, out, cols // 32, 32)
    amax = groups.abs().amax(-1).clamp_min(2.0**-120)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    return pack_nibbles(e2m1_codes(scaled)), (exponent + 127).to(torch.uint8)


def mxfp4_experts(key: str, w: torch.Tensor):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = mxfp4_pack(w)
    return {f"{key}_blocks": blocks, f"{key}_scales": scales}, convert_moe_packed_tensors(
        blocks, scales, dtype=torch.float32)


def is_gpt_oss_expert(key: str) -> bool:
    return key.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj"))


MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


# --- NVIDIA ModelOpt (written from the format description, numpy-style reference) ---------------

MODELOPT_NVFP4_GROUP = 16


def modelopt_fp8(key: str, w: torch.Tensor):
    """ModelOpt FP8: e4m3 codes, one F32 ``weight_scale`` per tensor (0-d) and a static ``input_scale``."""
    stored, reference = fp8_blocks(None, "_scale")(key, w)
    module = key[: -len(".weight")]
    return {**stored, f"{module}.input_scale": torch.tensor(0.5)}, reference


def modelopt_nvfp4(key: str, w: torch.Tensor):
    """ModelOpt NVFP4: ``weight`` U8 ``[out, in/2]`` (E2M1, low nibble first), ``weight_scale`` F8
    ``[out, in/16]`` and ``weight_scale_2`` F32 ``[]``, value ``fp4 · (weight_scale · weight_scale_2)``."""
    rows, cols = w.shape
    groups = w.reshape(rows, cols // MODELOPT_NVFP4_GROUP, MODELOPT_NVFP4_GROUP)
    scale_2 = (w.abs().max() / (6.0 * FP8_MAX)).reshape(())
    scale = (groups.abs().amax(-1) / 6.0 / scale_2).to(torch.float8_e4m3fn)
    full = scale.float() * scale_2  # float32, the order the format defines
    codes = e2m1_codes(groups / full.clamp_min(1e-30)[..., None]).reshape(rows, cols)
    reference = (E2M1[codes & 7] * (1 - 2 * (codes >> 3))).reshape(groups.shape) * full[..., None]
    module = key[: -len(".weight")]
    stored = {key: pack_nibbles(codes), f"{key}_scale": scale, f"{key}_scale_2": scale_2,
              f"{module}.input_scale": torch.tensor(0.25)}
    return stored, reference.reshape(rows, cols)


MODELOPT_FP8_FILE = SideFile(producer={"name": "modelopt", "version": "0.15.0"},
                             quantization={"quant_algo": "FP8", "kv_cache_quant_algo": None,
                                           "exclude_modules": ["lm_head"]})
MODELOPT_NVFP4_CONFIG = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": MODELOPT_NVFP4_GROUP,
                         "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}


# --- GPTQ and AWQ (packed in numpy from the format descriptions) ---------------------------------

# AutoAWQ's pack order: field k of each int32 holds output column AWQ_PACK_ORDER[k] of its 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def pack_int32(values: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """Unsigned ``bits``-bit ``values`` packed ``32 // bits`` per int32 along ``axis``: field ``k``
    of a word (bits ``[k*bits, (k+1)*bits)``) holds its element ``order[k]`` (default ``k``)."""
    per = 32 // bits
    moved = np.moveaxis(values.astype(np.uint32), axis, -1)
    fields = moved.reshape(*moved.shape[:-1], -1, per)
    if order is not None:
        fields = fields[..., list(order)]
    words = np.zeros(fields.shape[:-1], np.uint32)
    for k in range(per):
        words |= fields[..., k] << np.uint32(k * bits)
    return np.moveaxis(words.view(np.int32), -1, axis)


def int_quantize(w: np.ndarray, bits: int, g_idx: np.ndarray, sym: bool, min_zero: int = 0):
    """``w`` [out, in] quantized per group of input columns (``g_idx``): unsigned codes ``q``, zero
    points ``z`` [out, groups] (at least ``min_zero``), F16 scales ``s`` and the reference value
    ``(q - z[:, g_idx]) · s[:, g_idx]`` (float32)."""
    maxq = 2**bits - 1
    groups = int(g_idx.max()) + 1
    scale = np.zeros((w.shape[0], groups), np.float16)
    zero = np.zeros((w.shape[0], groups), np.int64)
    for g in range(groups):
        cols = w[:, g_idx == g]
        if sym:
            scale[:, g] = np.maximum(2 * np.abs(cols).max(1) / maxq, 1e-4)
            zero[:, g] = (maxq + 1) // 2
        else:
            lo, hi = np.minimum(cols.min(1), 0), np.maximum(cols.max(1), 0)
            scale[:, g] = np.maximum((hi - lo) / maxq, 1e-4)
            zero[:, g] = np.clip(np.round(-lo / scale[:, g].astype(np.float32)), min_zero, maxq)
    s, z = scale.astype(np.float32)[:, g_idx], zero[:, g_idx]
    q = np.clip(np.round(w / s) + z, 0, maxq).astype(np.int64)
    return q, zero, scale, ((q - z).astype(np.float32) * s).astype(np.float32)


def gptq_config(bits: int, group: int, desc_act: bool = False, sym: bool = True, fmt: str = "gptq") -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act, "sym": sym,
            "checkpoint_format": fmt, "damp_percent": 0.01, "true_sequential": True}


def gptq(config: dict) -> Quantizer:
    """GPTQ: ``qweight`` [in·b/32, out], ``qzeros`` [groups, out·b/32] (v1: zero − 1), F16
    ``scales`` [groups, out], ``g_idx`` [in] (a random activation order with ``desc_act``)."""
    bits, group = config["bits"], config["group_size"]
    v1 = config["checkpoint_format"] == "gptq"

    def quantize(key: str, w: torch.Tensor):
        cols = w.shape[1]
        g_idx = np.arange(cols) // (cols if group == -1 else group)
        if config["desc_act"]:
            order = np.random.default_rng(len(key)).permutation(cols)  # column order[k] quantized k-th
            g_idx = np.empty(cols, np.int64)
            g_idx[order] = np.arange(cols) // group
        q, zero, scale, reference = int_quantize(w.numpy(), bits, g_idx, config["sym"], min_zero=int(v1))
        module = key[: -len(".weight")]
        stored = {"qweight": pack_int32(q.T, bits, 0), "qzeros": pack_int32((zero - v1).T, bits, 1),
                  "scales": scale.T.copy(), "g_idx": g_idx.astype(np.int32)}
        return {f"{module}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in stored.items()}, \
            torch.from_numpy(reference)

    return quantize


AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}


def awq(key: str, w: torch.Tensor):
    """AWQ GEMM: ``qweight`` [in, out/8] and ``qzeros`` [groups, out/8] in AutoAWQ's pack order, F16
    ``scales`` [groups, out]."""
    group = AWQ_CONFIG["group_size"]
    q, zero, scale, reference = int_quantize(w.numpy(), 4, np.arange(w.shape[1]) // group, sym=False)
    module = key[: -len(".weight")]
    stored = {"qweight": pack_int32(q.T, 4, 1, AWQ_PACK_ORDER), "qzeros": pack_int32(zero.T, 4, 1, AWQ_PACK_ORDER),
              "scales": scale.T.copy()}
    return {f"{module}.{k}": torch.from_numpy(np.ascontiguousarray(v)) for k, v in stored.items()}, \
        torch.from_numpy(reference)


def load_reference(torch_model, reference: dict[str, np.ndarray], src: Path, dst: Path):
    """transformers' model of ``src``'s kind loaded (float32) from a copy of ``src`` with the dequantised
    ``reference`` weights (written to ``dst``): transformers does its own key conversions."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(shard)
        for key in tensors:
            if key in reference:
                tensors[key] = torch.from_numpy(reference[key])
        save_file(tensors, shard, metadata={"format": "pt"})
    return type(torch_model).from_pretrained(dst, dtype=torch.float32).eval()
