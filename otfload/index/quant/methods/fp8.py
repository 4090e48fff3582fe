"""FP8 weights with their scales: ``fp8`` (DeepSeek-V3, Qwen3-FP8, Ministral) and ``fbgemm_fp8``.

- ``fp8``: ``W`` F8 + ``W_scale_inv`` per ``weight_block_size`` block, or a single per-tensor (or
  per-row) scale when ``weight_block_size`` is null; with no ``quantization_config`` at all,
  DeepSeek-style ``_scale_inv`` pairs with the default block (:func:`legacy_fp8`). DeepSeek-V4
  (``scale_fmt: ue8m0``): ``X.weight`` F8 with ``X.scale`` F8_E8M0 per block, and its FP4 routed
  experts, ``X.weight`` I8 (two E2M1 a byte) with ``X.scale`` F8_E8M0 per 32 inputs.
- ``fbgemm_fp8``: ``W`` F8 + ``W_scale`` ``[out, 1]`` (per row); Llama 4's fused experts ``[E, in,
  out]`` with a scale per expert and output column.

:func:`fp8_pairs` and :func:`unscaled_fp8` serve ModelOpt's FP8 too.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np

from otfload.errors import ConfigError
from otfload.index.header import TensorInfo
from otfload.index.quant.codes import MX_BLOCK, PackedFp4Codes, PlainCodes
from otfload.index.quant.common import QuantConfig, ReadValues, Tensor, fail, stored
from otfload.index.quant.methods.scale_grid import as_grid, checked_scale, fit_block, is_e8m0, is_fp8, scale_part
from otfload.index.quant.scales import BlockScales
from otfload.index.quant.tensor import QuantizedTensor

# The scale of a fused expert tensor (``experts.gate_up_proj_scale``, ``experts.down_proj_scale``).
FUSED_EXPERT_SCALE = "_proj_scale"
# DeepSeek-V3's ``weight_block_size``, for FP8 ``_scale_inv`` checkpoints whose config omits it.
DEFAULT_FP8_BLOCK = (128, 128)
# DeepSeek-V4's scale of ``X.weight``: ``X.scale`` (transformers renames it ``X.weight_scale_inv``).
V4_SCALE = ".scale"
# Storage dtypes of FP4 codes packed two a byte (DeepSeek-V4 writes int8).
PACKED_FP4 = (np.dtype(np.int8), np.dtype(np.uint8))


def _int_list(qc: QuantConfig, name: str, length: int | None = None) -> tuple[int, ...] | None:
    value = qc.get(name)
    if value is None:
        return None
    ok = isinstance(value, list) and all(type(v) is int and v > 0 for v in value)
    if not ok or (length is not None and len(value) != length):
        shape = f"{length} " if length else ""
        raise ConfigError(f"quantization_config.{name}", value, f"a list of {shape}positive ints or null")
    return tuple(value)


def _per_tensor_or_block(method: str | None, weight: TensorInfo, scale: TensorInfo,
                         block: tuple[int, ...] | None) -> tuple[int, ...]:
    """The block of an FP8 scale: the configured block, else per tensor or per row by its shape."""
    if block is not None:
        return fit_block(block, len(weight.shape))
    if math.prod(scale.shape) == 1:
        return weight.shape
    if as_grid(scale, (*weight.shape[:-1], 1)) is not None:
        return (*(1,) * (len(weight.shape) - 1), weight.shape[-1])
    raise fail(method, f"scale {scale.name!r} {list(scale.shape)} of {weight.name!r} {list(weight.shape)} "
                        "is neither per tensor nor per row and weight_block_size is null")


def fp8_pairs(method: str | None, tensors: dict[str, Tensor], suffix: str,
              block: tuple[int, ...] | None, storage: str, weight_suffix: str = "") -> None:
    """Every FP8 weight ``W`` with a scale ``W<suffix>`` decoded in ``tensors`` (``block``: the scale
    block, None for per tensor or per row by the scale's shape); ``storage`` starts its description.

    ``weight_suffix`` names the weight of a scale as its name less ``suffix`` plus this (DeepSeek-V4's
    ``X.scale`` scales ``X.weight``): then a scale of no FP8 or int8 weight is not a companion (a
    model's own ``.scale`` parameter) and stays. Scales are float, or UE8M0 (``float8_e8m0fnu``); an
    int8 weight with UE8M0 scales is FP4 (:func:`_fp4_experts`)."""
    for key in [k for k in tensors if k.endswith(suffix)]:
        name = key[: -len(suffix)] + weight_suffix
        weight = tensors.get(name)
        if isinstance(weight, TensorInfo) and weight.dtype in PACKED_FP4 and is_e8m0(stored(method, key, tensors[key])):
            _fp4_experts(method, tensors, key, name, weight)
            continue
        if not isinstance(weight, TensorInfo) or not is_fp8(weight):
            if weight_suffix:
                continue
            what = "is missing" if weight is None else f"has dtype {weight.dtype}"
            raise fail(method, f"scale {key!r} belongs to {name!r}, which {what} (expected an FP8 weight)")
        scale = stored(method, key, tensors.pop(key))
        wblock = _per_tensor_or_block(method, weight, scale, block)
        stored_scale, codec = scale_part(checked_scale(method, weight, scale, wblock))
        what = _storage(storage, weight.dtype, scale.dtype, wblock, weight.shape)
        tensors[name] = QuantizedTensor(name, weight.shape, PlainCodes(weight),
                                        BlockScales(stored_scale, wblock, scale_codec=codec), what)


def _fp4_experts(method: str | None, tensors: dict[str, Tensor], key: str, name: str, weight: TensorInfo) -> None:
    """DeepSeek-V4's FP4 routed experts (``expert_dtype: fp4``): ``weight`` int8 ``[..., out, in/2]``,
    two E2M1 codes a byte, low nibble first, standing for ``[..., out, in]``, and its UE8M0 scale
    ``key`` ``[..., out, in/32]``, one per 32 inputs (MXFP4's numbers, not transposed)."""
    scale = stored(method, key, tensors.pop(key))
    shape = (*weight.shape[:-1], 2 * weight.shape[-1])
    block = fit_block((1, MX_BLOCK), len(shape))
    stored_scale, codec = scale_part(checked_scale(method, weight, scale, block, shape))
    codes = weight._replace(dtype=np.dtype(np.uint8))  # the same bytes, unpacked by nibble
    tensors[name] = QuantizedTensor(name, shape, PackedFp4Codes(codes), BlockScales(stored_scale, block,
                                    scale_codec=codec), f"fp4 e2m1 ({weight.dtype.name}, two a byte), "
                                    f"{scale.dtype.name} scale per {MX_BLOCK}")


@functools.lru_cache(maxsize=1024)  # a checkpoint's FP8 weights come in a few shapes: its layers repeat them
def _storage(storage: str, dtype: np.dtype[Any], scale: np.dtype[Any], block: tuple[int, ...],
             shape: tuple[int, ...]) -> str:
    """What ``otfload inspect`` shows of an FP8 weight (``dtype.name`` costs microseconds a call)."""
    return f"{storage} {dtype.name}, {scale.name} scale per {_blk(block, shape)}"


def _blk(block: tuple[int, ...], shape: tuple[int, ...]) -> str:
    if tuple(block) == tuple(shape):
        return "tensor"
    if all(b == 1 for b in block[:-1]) and block[-1] == shape[-1]:
        return "row"
    return "x".join(map(str, block)) + " block"


def fp8(qc: QuantConfig, tensors: dict[str, Tensor], _read: ReadValues) -> None:
    """``quant_method: fp8``: ``W_scale_inv`` per ``weight_block_size`` block (or per tensor or row),
    or DeepSeek-V4's ``X.scale`` of ``X.weight`` (UE8M0 per block; its FP4 experts per 32 inputs)."""
    block = _int_list(qc, "weight_block_size", 2) if "weight_block_size" in qc else DEFAULT_FP8_BLOCK
    fp8_pairs("fp8", tensors, "_scale_inv", block, "fp8")
    fp8_pairs("fp8", tensors, V4_SCALE, block, "fp8", weight_suffix=".weight")
    unscaled_fp8("fp8", tensors)


def legacy_fp8(tensors: dict[str, Tensor]) -> None:
    """No ``quantization_config``: DeepSeek-style ``_scale_inv`` pairs with the default block."""
    fp8_pairs(None, tensors, "_scale_inv", DEFAULT_FP8_BLOCK, "fp8")


def fbgemm_fp8(qc: QuantConfig, tensors: dict[str, Tensor], _read: ReadValues) -> None:
    """``quant_method: fbgemm_fp8``: ``W_scale`` per row; Llama 4's fused experts ``[E, in, out]``
    (``experts.gate_up_proj``, ``experts.down_proj``) with ``W_scale`` per expert and output column,
    ``[E, 1, out]`` or ``[E, out, 1]`` (transformers' ``FbgemmFp8Llama4TextExperts``: the same bytes)."""
    for key in [k for k in tensors if k.endswith((".weight_scale", FUSED_EXPERT_SCALE))]:
        name = key[: -len("_scale")]
        weight = tensors.get(name)
        if not isinstance(weight, TensorInfo) or not is_fp8(weight):
            raise fail("fbgemm_fp8", f"scale {key!r} has no FP8 weight {name!r}")
        fused = not key.endswith(".weight_scale")
        if fused and len(weight.shape) != 3:
            raise fail("fbgemm_fp8", f"fused expert weight {name!r} has shape {list(weight.shape)}; "
                                     "expected [experts, in, out]")
        scale = stored("fbgemm_fp8", key, tensors.pop(key))
        block = (1, weight.shape[1], 1) if fused else (*(1,) * (len(weight.shape) - 1), weight.shape[-1])
        scales = BlockScales(checked_scale("fbgemm_fp8", weight, scale, block), block)
        per = "per expert and column" if fused else "per row"
        tensors[name] = QuantizedTensor(name, weight.shape, PlainCodes(weight), scales,
                                        f"fbgemm_fp8 {weight.dtype.name}, {scale.dtype.name} scale {per}")
    unscaled_fp8("fbgemm_fp8", tensors)


def unscaled_fp8(method: str, tensors: dict[str, Tensor]) -> None:
    """A :class:`~otfload.errors.QuantizationError` for FP8 tensors left without a scale, and for
    UE8M0 scales left without a weight."""
    raw = [k for k, v in tensors.items() if isinstance(v, TensorInfo) and is_fp8(v)]
    if raw:
        raise fail(method, f"{len(raw)} FP8 tensor(s) have no scale, e.g. {raw[0]!r}")
    orphans = [k for k, v in tensors.items() if isinstance(v, TensorInfo) and is_e8m0(v)]
    if orphans:
        raise fail(method, f"{len(orphans)} UE8M0 scale(s) belong to no FP8 or FP4 weight, e.g. {orphans[0]!r}")
