"""Quantized copies of a bf16 benchmark checkpoint, derived in numpy (no torch): every ``*proj.weight``
becomes one of the layouts otfload decodes on the fly (docs/formats.md).

    python -m benchmarks.make_quantized --src bench_data/llama-0.5g --variant fp8|w4a16|all [--out DIR]

- ``fp8``: DeepSeek-V3 style, ``W`` F8_E4M3 codes + ``W_scale_inv`` F32 per 128×128 block
  (``quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}``).
- ``w4a16``: compressed-tensors ``pack-quantized``, symmetric int4 per group of 128 along the input
  axis: ``W_packed`` I32 ``[out, in/8]`` (element ``i`` of a row at bits ``[4i, 4i+4)`` of the row's
  little-endian bit stream, stored ``+8``), ``W_scale`` BF16 ``[out, in/128]``, ``W_shape`` I64 ``[2]``.
- ``gptq`` / ``awq``: the same int4 codes and groups (F16 scales) in GPTQ's and AWQ's layouts, stored
  ``[in, out]``-major (docs/formats.md): GPTQ ``qweight`` ``[in/8, out]`` packed along the input,
  v1 ``qzeros`` (8 stored as 7), ``g_idx``; AWQ ``qweight`` ``[in, out/8]`` packed along the output in
  AWQ's interleaved order, ``qzeros`` 8. Same values, other layouts: a comparison of layouts alone.

Every other tensor (embeddings, norms, ``lm_head``) is copied as it is, as published checkpoints do.
Files keep their names, so the index's shards map one to one. The safetensors writer is our own
(a few lines): ``safetensors.numpy`` cannot write F8 arrays. Output is streamed tensor by tensor, so
memory stays at about one tensor in float32.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
from collections.abc import Iterator
from pathlib import Path

import ml_dtypes
import numpy as np

from benchmarks.harness import safetensors_header

VARIANTS = ("fp8", "w4a16", "gptq", "awq")
INT_LAYOUTS = ("gptq", "awq")
# DeepSeek-V3's (and Qwen3-FP8's) weight_block_size: one scale per 128×128 block of [out, in].
FP8_BLOCK = (128, 128)
# Largest finite float8_e4m3fn value: a block's absolute maximum maps onto it (scale = amax / 448).
FP8_MAX = 448.0
# 4-bit integers, symmetric: codes in [-8, 7], scale = amax / 7 so that ±amax is representable.
W4_BITS = 4
W4_QMAX = 7
W4_QMIN = -8
# compressed-tensors stores a b-bit code as code + 2^(b-1) (unsigned), so 4-bit codes are stored +8.
W4_OFFSET = 1 << (W4_BITS - 1)
# The group size of published W4A16 checkpoints (llm-compressor's W4A16 preset, RedHatAI models).
W4_GROUP = 128
# Codes per int32 word of the packed stream.
W4_PER_WORD = 32 // W4_BITS
# The zero point every symmetric int4 code is stored against (GPTQ and AWQ store unsigned codes).
W4_ZERO = 8
# AutoAWQ's pack order: field k of a word holds output column AWQ_PACK_ORDER[k] of its 8.
AWQ_PACK_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# An all-zero block would give a zero scale and 0/0 codes: floor the scale (any positive value works,
# the codes are then 0 and so is the dequantised block).
MIN_SCALE = 1e-12

SAFETENSORS_NAMES = {
    np.dtype(ml_dtypes.float8_e4m3fn): "F8_E4M3",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
}
INDEX_FILE = "model.safetensors.index.json"


def is_quantized(name: str) -> bool:
    """The tensors this module quantizes: every linear projection of a Llama-shaped checkpoint."""
    return name.endswith("proj.weight")


def quantization_config(variant: str) -> dict:
    """The ``config.json`` ``quantization_config`` of ``variant``."""
    if variant == "fp8":
        return {"quant_method": "fp8", "weight_block_size": list(FP8_BLOCK)}
    if variant == "w4a16":  # tests/index/quant/layouts.py::ct_config("w4a16"), with group size 128
        weights = {"num_bits": W4_BITS, "type": "int", "strategy": "group", "group_size": W4_GROUP, "symmetric": True}
        return {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ["lm_head"],
        }
    if variant == "gptq":
        return {"quant_method": "gptq", "bits": W4_BITS, "group_size": W4_GROUP, "desc_act": False, "sym": True,
                "checkpoint_format": "gptq"}
    if variant == "awq":
        return {"quant_method": "awq", "bits": W4_BITS, "group_size": W4_GROUP, "zero_point": True, "version": "gemm"}
    raise ValueError(f"unknown variant {variant!r} (expected one of {VARIANTS})")


# --- quantizers (pure functions) -------------------------------------------------------------------


def _block_grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def fp8_quantize(w: np.ndarray, block: tuple[int, int] = FP8_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """``w`` [out, in] as F8_E4M3 codes and F32 ``scale_inv`` [⌈out/b0⌉, ⌈in/b1⌉] with ``w ≈ codes · scale``."""
    rows, cols = w.shape
    g0, g1 = _block_grid(w.shape, block)
    padded = np.zeros((g0 * block[0], g1 * block[1]), np.float32)
    padded[:rows, :cols] = w
    blocks = padded.reshape(g0, block[0], g1, block[1])
    scale = np.maximum(np.abs(blocks).max(axis=(1, 3)) / FP8_MAX, MIN_SCALE).astype(np.float32)
    blocks /= scale[:, None, :, None]
    codes = padded[:rows, :cols].astype(ml_dtypes.float8_e4m3fn)
    return codes, scale


def w4a16_quantize(w: np.ndarray, group: int = W4_GROUP) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``w`` [out, in] as compressed-tensors ``pack-quantized`` symmetric int4: ``packed`` I32
    [out, in/8], ``scale`` BF16 [out, in/group], ``shape`` I64 [2]."""
    rows, cols = w.shape
    if cols % group or group % W4_PER_WORD:
        raise ValueError(f"in={cols} must be a multiple of the group {group}, itself a multiple of {W4_PER_WORD}")
    groups = w.astype(np.float32).reshape(rows, cols // group, group)
    scale = np.maximum(np.abs(groups).max(axis=-1) / W4_QMAX, MIN_SCALE).astype(ml_dtypes.bfloat16)
    # Codes are rounded against the stored (bf16) scale, so stored codes · stored scale is the value.
    q = np.clip(np.rint(groups / scale.astype(np.float32)[..., None]), W4_QMIN, W4_QMAX).reshape(rows, cols)
    stored = (q + W4_OFFSET).astype(np.uint8)
    nibbles = stored[:, 0::2] | (stored[:, 1::2] << 4)  # element 2j in the low nibble of byte j
    packed = np.ascontiguousarray(nibbles).view("<i4").astype(np.int32, copy=False)
    return packed, scale, np.array([rows, cols], np.int64)


def w4a16_dequantize(packed: np.ndarray, scale: np.ndarray, group: int = W4_GROUP) -> np.ndarray:
    """The float32 reference value of :func:`w4a16_quantize`'s output."""
    data = np.ascontiguousarray(packed).astype("<i4", copy=False).view(np.uint8)
    codes = np.empty((data.shape[0], data.shape[1] * 2), np.float32)
    codes[:, 0::2] = data & 0x0F
    codes[:, 1::2] = data >> 4
    codes -= W4_OFFSET
    return codes * np.repeat(scale.astype(np.float32), group, axis=1)


def _pack_fields(fields: np.ndarray) -> np.ndarray:
    """``[..., 8]`` 4-bit fields as one int32 per row, field ``k`` in bits ``[4k, 4k+4)``."""
    words = np.zeros(fields.shape[:-1], np.uint32)
    for k in range(W4_PER_WORD):
        words |= fields[..., k].astype(np.uint32) << np.uint32(W4_BITS * k)
    return words.view(np.int32)


def int_layout_quantize(variant: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """:func:`w4a16_quantize`'s codes and scales (as F16) in the GPTQ or AWQ layout, by role."""
    packed, scale, _ = w4a16_quantize(w)
    rows, cols = w.shape
    data = packed.astype("<i4", copy=False).view(np.uint8)
    codes = np.empty((rows, cols), np.uint8)  # unsigned: the signed code + 8
    codes[:, 0::2], codes[:, 1::2] = data & 0x0F, data >> 4
    stored_in_out = codes.T  # [in, out]
    groups = cols // W4_GROUP
    scales = scale.astype(np.float16).T.copy()  # bf16 values fit f16's range here (|w| < 65504)
    if variant == "gptq":  # rows of [in, out] packed 8 per word; v1 stores the zero point minus one
        qweight = _pack_fields(np.moveaxis(stored_in_out.reshape(cols // W4_PER_WORD, W4_PER_WORD, rows), 1, -1))
        qzeros = _pack_fields(np.full((groups, rows // W4_PER_WORD, W4_PER_WORD), W4_ZERO - 1))
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales,
                "g_idx": (np.arange(cols) // W4_GROUP).astype(np.int32)}
    fields = stored_in_out.reshape(cols, rows // W4_PER_WORD, W4_PER_WORD)[..., list(AWQ_PACK_ORDER)]
    qzeros = _pack_fields(np.full((groups, rows // W4_PER_WORD, W4_PER_WORD), W4_ZERO))
    return {"qweight": _pack_fields(fields), "qzeros": qzeros, "scales": scales}


def quantize_tensor(variant: str, name: str, w: np.ndarray) -> dict[str, np.ndarray]:
    """The stored tensors standing for ``name`` (``w``) in ``variant``; ``{name: w}`` if not quantized."""
    if not is_quantized(name):
        return {name: w}
    if variant == "fp8":
        codes, scale = fp8_quantize(w)
        return {name: codes, f"{name}_scale_inv": scale}
    module = name[: -len(".weight")]
    if variant in INT_LAYOUTS:
        return {f"{module}.{role}": value for role, value in int_layout_quantize(variant, w).items()}
    packed, scale, shape = w4a16_quantize(w)
    return {f"{module}.weight_packed": packed, f"{module}.weight_scale": scale, f"{module}.weight_shape": shape}


def stored_specs(variant: str, name: str, shape: tuple[int, ...]) -> list[tuple[str, np.dtype, tuple[int, ...]]]:
    """(name, dtype, shape) of what :func:`quantize_tensor` stores for ``name`` — known before the data,
    so a file's header is written first and its tensors streamed after it."""
    if not is_quantized(name):
        return [(name, np.dtype(ml_dtypes.bfloat16), shape)]
    rows, cols = shape
    if variant == "fp8":
        return [(name, np.dtype(ml_dtypes.float8_e4m3fn), shape),
                (f"{name}_scale_inv", np.dtype(np.float32), _block_grid(shape, FP8_BLOCK))]
    module = name[: -len(".weight")]
    i32, f16, groups = np.dtype(np.int32), np.dtype(np.float16), cols // W4_GROUP
    if variant == "gptq":
        return [(f"{module}.qweight", i32, (cols // W4_PER_WORD, rows)),
                (f"{module}.qzeros", i32, (groups, rows // W4_PER_WORD)),
                (f"{module}.scales", f16, (groups, rows)), (f"{module}.g_idx", i32, (cols,))]
    if variant == "awq":
        return [(f"{module}.qweight", i32, (cols, rows // W4_PER_WORD)),
                (f"{module}.qzeros", i32, (groups, rows // W4_PER_WORD)), (f"{module}.scales", f16, (groups, rows))]
    return [(f"{module}.weight_packed", np.dtype(np.int32), (rows, cols // W4_PER_WORD)),
            (f"{module}.weight_scale", np.dtype(ml_dtypes.bfloat16), (rows, cols // W4_GROUP)),
            (f"{module}.weight_shape", np.dtype(np.int64), (2,))]


# --- safetensors I/O ----------------------------------------------------------------------------------


def iter_tensors(path: Path) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) of every tensor of a bf16/float safetensors file, in file order (memory-mapped)."""
    header, data_start = safetensors_header(path)
    raw = np.memmap(path, np.uint8, mode="r")
    names = {"BF16": ml_dtypes.bfloat16, "F32": np.float32, "F16": np.float16}
    for name, spec in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        begin, end = spec["data_offsets"]
        data = raw[data_start + begin : data_start + end]
        yield name, data.view(names[spec["dtype"]]).reshape(spec["shape"])


def write_streamed(path: Path, specs: list[tuple[str, np.dtype, tuple[int, ...]]], arrays: Iterator[dict]) -> None:
    """Write a safetensors file whose tensors ``specs`` lists (in order); ``arrays`` yields dicts of
    them in that order, checked against the specs as they are written."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, dtype, shape in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": SAFETENSORS_NAMES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    pending = iter(specs)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for produced in arrays:
            for name, value in produced.items():
                want = next(pending)
                if (name, value.dtype, value.shape) != (want[0], want[1], tuple(want[2])):
                    raise AssertionError(f"{path.name}: wrote {name} {value.dtype}{value.shape}, header says {want}")
                f.write(np.ascontiguousarray(value).tobytes())
    if next(pending, None) is not None:
        raise AssertionError(f"{path.name}: fewer tensors written than the header lists")


# --- checkpoints -------------------------------------------------------------------------------------


def default_out(src: Path, variant: str) -> Path:
    return src.parent / f"{src.name}-{variant}"


def expected_config(src: Path, variant: str) -> dict:
    config = json.loads((src / "config.json").read_text())
    return {**config, "quantization_config": quantization_config(variant)}


def write_quantized(src: Path, variant: str, out: Path) -> Path:
    """Write ``variant``'s copy of the checkpoint ``src`` into ``out``; returns ``out``."""
    quantization_config(variant)  # validates the name
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.safetensors"):
        old.unlink()
    weight_map, total = {}, 0
    for shard in sorted(src.glob("*.safetensors")):
        header, _ = safetensors_header(shard)
        order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
        specs = [s for name in order for s in stored_specs(variant, name, tuple(header[name]["shape"]))]
        produced = (quantize_tensor(variant, name, w) for name, w in iter_tensors(shard))
        write_streamed(out / shard.name, specs, produced)
        weight_map.update({name: shard.name for name, _, _ in specs})
        total += sum(math.prod(shape) * dtype.itemsize for _, dtype, shape in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / INDEX_FILE).write_text(json.dumps(index, indent=1))
    # config.json last: ensure_quantized takes a matching config as "this copy is complete".
    (out / "config.json").write_text(json.dumps(expected_config(src, variant), indent=1))
    return out


def ensure_quantized(src: Path, variant: str, out: Path | None = None) -> Path:
    """``variant``'s copy of ``src``, written first if it is missing, incomplete or of another shape."""
    out = default_out(src, variant) if out is None else out
    config, index = out / "config.json", out / INDEX_FILE
    complete = config.exists() and index.exists() and json.loads(config.read_text()) == expected_config(src, variant)
    if complete:
        files = set(json.loads(index.read_text())["weight_map"].values())
        complete = files == {p.name for p in src.glob("*.safetensors")} and all((out / f).exists() for f in files)
    if not complete:
        if config.exists():
            config.unlink()
        write_quantized(src, variant, out)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--src", type=Path, required=True, help="a bf16 checkpoint (benchmarks.make_checkpoint)")
    parser.add_argument("--variant", choices=(*VARIANTS, "all"), default="all")
    parser.add_argument("--out", type=Path, default=None, help="default: <src>-<variant> (one variant only)")
    args = parser.parse_args(argv)
    variants = VARIANTS if args.variant == "all" else (args.variant,)
    if args.out is not None and len(variants) > 1:
        parser.error("--out needs a single --variant")
    for variant in variants:
        out = write_quantized(args.src, variant, args.out or default_out(args.src, variant))
        size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
        print(f"{out}: {variant}, {size / 2**30:.3f} GiB")


if __name__ == "__main__":
    main()
