"""Which quantized layout a checkpoint uses, from ``quantization_config`` and its tensor set.

:func:`dequantized_view` turns the index's tensors into the tensors the model wants: every stored
quantized weight (codes plus scales, zero points, global scales) becomes one
:class:`~otfload.index.quant.tensor.QuantizedTensor` under the dequantised parameter's name, and
activation-side tensors (``input_scale``, ``k_scale``, ...) move aside for the load report. The
layout of each weight is decided by the tensors present; the config supplies the parameters (bits,
strategy, group and block sizes) and is cross-checked against them.

Never silently wrong: an unknown ``quant_method``, a scale or zero point no rule explains, or a
scale whose shape does not fit its weight is a :class:`~otfload.errors.QuantizationError` whatever
``strict`` says — dropping a scale as "unexpected" would load raw codes as weights.

Layouts (docs/formats.md has the math and the references each was checked against):

- ``fp8`` (DeepSeek-V3, Qwen3-FP8, Ministral): ``W`` F8 + ``W_scale_inv`` per
  ``weight_block_size`` block, or a single per-tensor scale when ``weight_block_size`` is null.
- ``fbgemm_fp8``: ``W`` F8 + ``W_scale`` ``[out, 1]`` (per row).
- ``compressed-tensors``: ``float-quantized`` / ``int-quantized`` (``weight`` F8/I8 +
  ``weight_scale`` per tensor/channel/group/block, optional ``weight_zero_point``),
  ``pack-quantized`` (``weight_packed`` I32 + ``weight_shape``, zero points packed along rows),
  ``nvfp4-pack-quantized`` (``weight_packed`` U8 + F8 ``weight_scale`` per 16 + ``weight_global_scale``).
- ``mxfp4`` (GPT-OSS): ``X_blocks`` U8 ``[..., out, in/32, 16]`` + ``X_scales`` E8M0.
- ``gptq`` and ``awq``: int32-packed codes and zero points stored ``[in, out]``-major
  (:mod:`otfload.index.quant.intlinear`).
- ``modelopt`` (NVIDIA ModelOpt; ``hf_quant_config.json`` beside ``config.json`` or
  ``quantization_config``): FP8 ``weight`` + ``weight_scale`` per tensor or per row; NVFP4
  ``weight`` U8 (two E2M1 codes per byte) + F8 ``weight_scale`` per 16 + ``weight_scale_2`` (one
  value that *multiplies*, where compressed-tensors' global scale divides).
"""

from __future__ import annotations

import fnmatch
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from otfload.errors import ConfigError, QuantizationError, UnsupportedQuantizationError
from otfload.index.header import TensorInfo
from otfload.index.quant.common import QuantConfig, ReadValues, Tensor, fail, stored
from otfload.index.quant.intlinear import awq, gptq
from otfload.index.quant.tensor import (
    MX_BLOCK,
    MX_BLOCK_BYTES,
    BlockScales,
    Codes,
    Mxfp4Codes,
    PackedFp4Codes,
    PackedIntCodes,
    PlainCodes,
    QuantizedTensor,
    as_grid,
)

# DeepSeek-V3's ``weight_block_size``, for FP8 ``_scale_inv`` checkpoints whose config omits it.
DEFAULT_FP8_BLOCK = (128, 128)
# NVFP4 shares one FP8 scale between 16 FP4 values (the format fixes it).
NVFP4_GROUP = 16
# Methods transformers knows that otfload detects but does not decode yet.
NOT_YET_SUPPORTED = frozenset({
    "bitsandbytes", "aqlm", "eetq", "hqq", "quanto", "torchao", "exl2", "higgs",
    "vptq", "spqr", "bitnet", "fp_quant", "auto-round", "quark", "fbgemm_fp4", "mxfp8",
})
# ModelOpt's ``quant_algo`` values decoded here, by the codes they store.
MODELOPT_FP8 = frozenset({"FP8", "FP8_PER_CHANNEL_PER_TOKEN"})
MODELOPT_NVFP4 = "NVFP4"
# The file ModelOpt exports write beside config.json (older exports: instead of quantization_config).
HF_QUANT_CONFIG = "hf_quant_config.json"
# Tensors that belong to a quantized weight; one left over after decoding is an error.
COMPANION = re.compile(
    r"(_scale_inv|_scale|_scale_2|_scales|_zero_point|_blocks|_packed|_shape|_g_idx|\.qweight|\.qzeros"
    r"|\.g_idx|\.SCB|\.absmax|\.quant_map|\.quant_state\..*)$"
)
# Scales of activations and the KV cache: reported, never folded into weights.
ACTIVATION = re.compile(
    r"\.(input_scale|input_global_scale|input_zero_point|output_scale|output_zero_point|"
    r"k_scale|v_scale|q_scale|kv_scale|activation_scale|input_scale_ub)$"
)


@dataclass
class QuantizedView:
    """The index's tensors with every quantized weight decoded, plus the activation-side tensors."""

    tensors: dict[str, Tensor]
    method: str | None = None
    activation: dict[str, TensorInfo] = field(default_factory=dict)


def _int_list(qc: QuantConfig, name: str, length: int | None = None) -> tuple[int, ...] | None:
    value = qc.get(name)
    if value is None:
        return None
    ok = isinstance(value, list) and all(type(v) is int and v > 0 for v in value)
    if not ok or (length is not None and len(value) != length):
        shape = f"{length} " if length else ""
        raise ConfigError(f"quantization_config.{name}", value, f"a list of {shape}positive ints or null")
    return tuple(value)


def _grid(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(-(-d // b) for d, b in zip(shape, block, strict=True))


def _fit_block(block: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """A block over the last ``len(block)`` axes, one element along any leading (expert) axes."""
    return (1,) * (ndim - len(block)) + block


def _checked_scale(method: str | None, weight: Tensor, scale: TensorInfo, block: tuple[int, ...],
                   shape: tuple[int, ...] | None = None) -> TensorInfo:
    shape = shape or weight.shape
    grid = _grid(shape, block)
    fitted = as_grid(scale, grid)
    if fitted is None:
        raise fail(method, f"scale {scale.name!r} has shape {list(scale.shape)}; weight {weight.name!r} "
                            f"{list(shape)} with blocks {list(block)} needs {list(grid)}")
    if not np.issubdtype(scale.dtype, np.floating) and scale.dtype.kind != "V":
        raise fail(method, f"scale {scale.name!r} has dtype {scale.dtype}, expected a float dtype")
    return fitted


def _is_fp8(info: TensorInfo) -> bool:
    return "float8" in info.dtype.name


def _per_tensor_or_block(method: str | None, weight: TensorInfo, scale: TensorInfo,
                         block: tuple[int, ...] | None) -> tuple[int, ...]:
    """The block of an FP8 scale: the configured block, else per tensor or per row by its shape."""
    if block is not None:
        return _fit_block(block, len(weight.shape))
    if math.prod(scale.shape) == 1:
        return weight.shape
    if as_grid(scale, (*weight.shape[:-1], 1)) is not None:
        return (*(1,) * (len(weight.shape) - 1), weight.shape[-1])
    raise fail(method, f"scale {scale.name!r} {list(scale.shape)} of {weight.name!r} {list(weight.shape)} "
                        "is neither per tensor nor per row and weight_block_size is null")


def _fp8_pairs(method: str | None, tensors: dict[str, Tensor], suffix: str,
               block: tuple[int, ...] | None, storage: str) -> None:
    for key in [k for k in tensors if k.endswith(suffix)]:
        name = key[: -len(suffix)]
        weight = tensors.get(name)
        if not isinstance(weight, TensorInfo) or not _is_fp8(weight):
            what = "is missing" if weight is None else f"has dtype {weight.dtype}"
            raise fail(method, f"scale {key!r} belongs to {name!r}, which {what} (expected an FP8 weight)")
        scale = stored(method, key, tensors.pop(key))
        wblock = _per_tensor_or_block(method, weight, scale, block)
        scales = BlockScales(_checked_scale(method, weight, scale, wblock), wblock)
        what = f"{storage} {weight.dtype.name}, {scale.dtype.name} scale per {_blk(wblock, weight.shape)}"
        tensors[name] = QuantizedTensor(name, weight.shape, PlainCodes(weight), scales, what)


def _blk(block: tuple[int, ...], shape: tuple[int, ...]) -> str:
    if tuple(block) == tuple(shape):
        return "tensor"
    if all(b == 1 for b in block[:-1]) and block[-1] == shape[-1]:
        return "row"
    return "x".join(map(str, block)) + " block"


def _fp8(qc: QuantConfig, tensors: dict[str, Tensor], _read: ReadValues) -> None:
    block = _int_list(qc, "weight_block_size", 2) if "weight_block_size" in qc else DEFAULT_FP8_BLOCK
    _fp8_pairs("fp8", tensors, "_scale_inv", block, "fp8")
    _unscaled_fp8("fp8", tensors)


def _legacy_fp8(tensors: dict[str, Tensor]) -> None:
    """No ``quantization_config``: DeepSeek-style ``_scale_inv`` pairs with the default block."""
    _fp8_pairs(None, tensors, "_scale_inv", DEFAULT_FP8_BLOCK, "fp8")


def _fbgemm_fp8(qc: QuantConfig, tensors: dict[str, Tensor], _read: ReadValues) -> None:
    for key in [k for k in tensors if k.endswith(".weight_scale")]:
        name = key[: -len("_scale")]
        weight = tensors.get(name)
        if not isinstance(weight, TensorInfo) or not _is_fp8(weight):
            raise fail("fbgemm_fp8", f"scale {key!r} has no FP8 weight {name!r}")
        scale = stored("fbgemm_fp8", key, tensors.pop(key))
        block = (*(1,) * (len(weight.shape) - 1), weight.shape[-1])
        scales = BlockScales(_checked_scale("fbgemm_fp8", weight, scale, block), block)
        tensors[name] = QuantizedTensor(name, weight.shape, PlainCodes(weight), scales,
                                        f"fbgemm_fp8 {weight.dtype.name}, {scale.dtype.name} scale per row")
    _unscaled_fp8("fbgemm_fp8", tensors)


def _unscaled_fp8(method: str, tensors: dict[str, Tensor]) -> None:
    raw = [k for k, v in tensors.items() if isinstance(v, TensorInfo) and _is_fp8(v)]
    if raw:
        raise fail(method, f"{len(raw)} FP8 tensor(s) have no scale, e.g. {raw[0]!r}")


def _mxfp4(qc: QuantConfig, tensors: dict[str, Tensor], _read: ReadValues) -> None:
    for key in [k for k in tensors if k.endswith("_blocks")]:
        name = key[: -len("_blocks")]
        blocks, stored_scales = stored("mxfp4", key, tensors[key]), tensors.get(f"{name}_scales")
        if stored_scales is None:
            raise fail("mxfp4", f"{key!r} has no {name + '_scales'!r}")
        scales = stored("mxfp4", f"{name}_scales", stored_scales)
        if (blocks.dtype != np.uint8 or scales.dtype != np.uint8 or len(blocks.shape) < 3
                or blocks.shape[-1] != MX_BLOCK_BYTES or scales.shape != blocks.shape[:-1]):
            raise fail("mxfp4", f"{key!r} {blocks.dtype}{list(blocks.shape)} and {name}_scales "
                                 f"{scales.dtype}{list(scales.shape)} are not U8 [..., out, in/32, 16] and "
                                 "U8 [..., out, in/32]")
        if name in tensors:
            raise fail("mxfp4", f"{name!r} is stored both quantized and unquantized")
        *lead, out, groups, _ = blocks.shape
        del tensors[key], tensors[f"{name}_scales"]
        tensors[name] = QuantizedTensor(name, (*lead, groups * MX_BLOCK, out), Mxfp4Codes(blocks, scales), None,
                                        "mxfp4 (e2m1 codes, e8m0 scale per 32; stored transposed)")


@dataclass(frozen=True)
class _WeightArgs:
    """The weight quantization arguments of one compressed-tensors config group."""

    num_bits: int
    type: str
    strategy: str
    group_size: int | None
    block: tuple[int, ...] | None
    symmetric: bool

    @classmethod
    def parse(cls, group: str, weights: object) -> _WeightArgs:
        where = f"quantization_config.config_groups.{group}.weights"
        if not isinstance(weights, Mapping):
            raise ConfigError(where, weights, "an object")
        bits = weights.get("num_bits", 8)
        if type(bits) is not int or not 1 <= bits <= 8:
            raise ConfigError(f"{where}.num_bits", bits, "an int in [1, 8]")
        kind = weights.get("type", "int")
        if kind not in ("int", "float"):
            raise ConfigError(f"{where}.type", kind, "'int' or 'float'")
        strategy = weights.get("strategy", "tensor")
        if strategy not in ("tensor", "channel", "group", "tensor_group", "block"):
            raise UnsupportedQuantizationError(
                f"compressed-tensors: {where}.strategy {strategy!r} is not supported yet")
        group_size = weights.get("group_size")
        if strategy in ("group", "tensor_group") and (type(group_size) is not int or group_size <= 0):
            raise ConfigError(f"{where}.group_size", group_size, "a positive int for group strategies")
        block = weights.get("block_structure")
        if strategy == "block":
            if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
                raise ConfigError(f"{where}.block_structure", block, "a list of 2 positive ints")
            block = tuple(block)
        symmetric = weights.get("symmetric", True)
        if not isinstance(symmetric, bool):
            raise ConfigError(f"{where}.symmetric", symmetric, "a bool")
        if weights.get("actorder") not in (None, False, "weight", "static"):
            raise UnsupportedQuantizationError(f"compressed-tensors: {where}.actorder "
                                               f"{weights.get('actorder')!r} (g_idx) is not supported yet")
        return cls(bits, kind, strategy, group_size, block if strategy == "block" else None, symmetric)

    def block_of(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        lead = (1,) * (len(shape) - 1)
        if self.strategy == "tensor":
            return shape
        if self.strategy == "channel":
            return (*lead, shape[-1])
        if self.strategy in ("group", "tensor_group"):
            assert self.group_size is not None  # parse() requires one for group strategies
            return (*lead, self.group_size)
        assert self.block is not None  # parse() requires block_structure for the block strategy
        return _fit_block(self.block, len(shape))


def _targets_match(targets: object, module: str) -> bool:
    if not isinstance(targets, list):
        return False
    for target in targets:
        if not isinstance(target, str):
            continue
        if target == "Linear" or target == module or (target.startswith("re:") and re.match(target[3:], module)):
            return True
    return False


def _compressed_tensors(qc: QuantConfig, tensors: dict[str, Tensor], read: ReadValues) -> None:
    groups = qc.get("config_groups", {})
    if not isinstance(groups, Mapping):
        raise ConfigError("quantization_config.config_groups", groups, "an object of quantization groups")
    ignore = qc.get("ignore", [])
    if not isinstance(ignore, list):
        raise ConfigError("quantization_config.ignore", ignore, "a list of module names or 're:' patterns")
    parsed = [(name, g.get("targets") if isinstance(g, Mapping) else None,
               _WeightArgs.parse(name, g.get("weights") if isinstance(g, Mapping) else g))
              for name, g in groups.items()]
    modules = sorted({k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_scale")})
    shapes = _packed_shapes(tensors, modules, read)
    for module in modules:
        if _targets_match(ignore, module):
            raise fail("compressed-tensors", f"{module!r} has quantization scales but is listed in 'ignore'")
        args = next((a for _, t, a in parsed if _targets_match(t, module)), None)
        if args is None:
            raise fail("compressed-tensors", f"{module!r} has quantization scales but no config group targets it")
        tensors[f"{module}.weight"] = _ct_weight(module, args, tensors, shapes.get(module))


def _packed_shapes(tensors: dict[str, Tensor], modules: list[str], read: ReadValues) -> dict[str, tuple[int, ...]]:
    """``weight_shape`` of every pack-quantized module, read in one batch (they are tiny)."""
    method = "compressed-tensors"
    infos = [stored(method, f"{m}.weight_shape", tensors[f"{m}.weight_shape"])
             for m in modules if f"{m}.weight_shape" in tensors]
    for info in infos:
        if info.dtype.kind not in "iu" or len(info.shape) != 1 or info.shape[0] > 8:
            raise fail(method, f"{info.name!r} {info.dtype}{list(info.shape)} is not an integer shape")
    out = {}
    for info, values in zip(infos, read(infos), strict=True):
        shape = tuple(int(v) for v in values)
        if any(d <= 0 for d in shape):
            raise fail(method, f"{info.name!r} holds an invalid shape {list(shape)}")
        out[info.name[: -len(".weight_shape")]] = shape
    return out


def _ct_weight(module: str, args: _WeightArgs, tensors: dict[str, Tensor],
               packed_shape: tuple[int, ...] | None) -> QuantizedTensor:
    method = "compressed-tensors"
    companions = {role: tensors.pop(f"{module}.weight_{role}", None)
                  for role in ("scale", "zero_point", "global_scale", "packed", "shape")}
    found = {role: stored(method, f"{module}.weight_{role}", t) for role, t in companions.items() if t is not None}
    scale = found["scale"]
    zero, global_scale, packed = found.get("zero_point"), found.get("global_scale"), found.get("packed")
    if f"{module}.weight_g_idx" in tensors:
        raise UnsupportedQuantizationError(f"compressed-tensors: {module}.weight_g_idx (activation order) "
                                           "is not supported yet")
    name = f"{module}.weight"
    codes: Codes
    if packed is not None:
        if name in tensors:
            raise fail(method, f"{module!r} has both 'weight' and 'weight_packed'")
        if packed.dtype == np.uint8:
            if args.type != "float" or args.num_bits != 4 or global_scale is None:
                raise fail(method, f"{packed.name!r} is U8 (NVFP4) but its group is {args.type}{args.num_bits} "
                                    f"{'without' if global_scale is None else 'with'} a weight_global_scale")
            shape = (*packed.shape[:-1], packed.shape[-1] * 2)
            codes = PackedFp4Codes(packed)
            storage = "nvfp4 (e2m1 codes, fp8 scale per 16, global scale)"
        elif packed.dtype == np.int32:
            if args.type != "int" or packed_shape is None:
                raise fail(method, f"{packed.name!r} is I32-packed but its group is {args.type} or "
                                    f"{module}.weight_shape is missing")
            shape = packed_shape
            if len(shape) != len(packed.shape) or shape[:-1] != packed.shape[:-1] or \
                    -(-shape[-1] * args.num_bits // 32) != packed.shape[-1]:
                raise fail(method, f"{packed.name!r} {list(packed.shape)} does not hold {list(shape)} at "
                                    f"{args.num_bits} bits")
            codes = PackedIntCodes(packed, args.num_bits)
            storage = f"int{args.num_bits} packed, {args.strategy}"
        else:
            raise fail(method, f"{packed.name!r} has dtype {packed.dtype}, expected I32 or U8")
    else:
        weight = tensors.get(name)
        if not isinstance(weight, TensorInfo) or not (_is_fp8(weight) or weight.dtype == np.int8):
            what = "missing" if weight is None else f"{weight.dtype}"
            raise fail(method, f"{module}.weight_scale needs an FP8 or I8 {name!r}, found {what}")
        shape, codes = weight.shape, PlainCodes(weight)
        storage = f"{weight.dtype.name} {args.strategy}"
    block = args.block_of(shape)
    if args.strategy == "tensor_group" and global_scale is None:
        raise fail(method, f"{module!r} uses tensor_group scales but has no weight_global_scale")
    if global_scale is not None and math.prod(global_scale.shape) != 1:
        raise fail(method, f"{global_scale.name!r} has shape {list(global_scale.shape)}, expected one value")
    if isinstance(codes, PackedFp4Codes) and block[-1] != NVFP4_GROUP:
        raise fail(method, f"{module!r} is NVFP4 with group size {block[-1]}, expected {NVFP4_GROUP}")
    placeholder = TensorInfo(name, np.dtype(np.float32), shape, "", 0, 0)
    fitted = _checked_scale(method, placeholder, scale, block, shape)
    zero_bits, fitted_zero = 0, None
    if zero is not None:
        grid = _grid(shape, block)
        if isinstance(codes, PackedIntCodes) and args.strategy in ("group", "channel"):
            zero_bits = args.num_bits
            packed_rows = -(-grid[-2] * zero_bits // 32)
            fitted_zero = as_grid(zero, (*grid[:-2], packed_rows, grid[-1]))
        else:
            fitted_zero = as_grid(zero, grid)
        if fitted_zero is None or zero.dtype.kind not in "iu":
            raise fail(method, f"zero point {zero.name!r} {zero.dtype}{list(zero.shape)} does not fit "
                                f"{list(grid)} scale blocks")
    elif not args.symmetric:
        raise fail(method, f"{module!r} is asymmetric but has no weight_zero_point")
    if global_scale is not None:
        global_scale = global_scale._replace(shape=(1,))
    scales = BlockScales(fitted, block, fitted_zero, zero_bits, global_scale)
    return QuantizedTensor(name, shape, codes, scales, f"compressed-tensors {storage}")


def _modelopt_fields(qc: QuantConfig) -> tuple[str, list[str], int | None]:
    """``(quant_algo, exclude_modules, group_size)`` of a ModelOpt config: ``hf_quant_config.json``
    (its ``quantization`` object) or a ``quantization_config`` with ``quant_method: modelopt``."""
    inner = qc.get("quantization", qc)
    where = "quantization_config" + (".quantization" if "quantization" in qc else "")
    if not isinstance(inner, Mapping):
        raise ConfigError(where, inner, "an object with a 'quant_algo'")
    algo = inner.get("quant_algo")
    if not isinstance(algo, str):
        raise ConfigError(f"{where}.quant_algo", algo, "a string")
    key = "exclude_modules" if "exclude_modules" in inner else "ignore"
    exclude = inner.get(key) or []
    if not (isinstance(exclude, list) and all(isinstance(m, str) for m in exclude)):
        raise ConfigError(f"{where}.{key}", exclude, "a list of module names or wildcard patterns")
    group = inner.get("group_size")
    if group is not None and (type(group) is not int or group <= 0):
        raise ConfigError(f"{where}.group_size", group, "a positive int")
    return algo.upper(), exclude, group


def _excluded(patterns: list[str], module: str) -> bool:
    return any(fnmatch.fnmatchcase(module, p) or module.startswith(p + ".") for p in patterns)


def _modelopt(qc: QuantConfig, tensors: dict[str, Tensor], _read: ReadValues) -> None:
    method = "modelopt"
    algo, exclude, group = _modelopt_fields(qc)
    if algo not in MODELOPT_FP8 and algo != MODELOPT_NVFP4:
        raise UnsupportedQuantizationError(f"modelopt: quant_algo {algo!r} is not supported yet (supported: "
                                           f"{', '.join(sorted(MODELOPT_FP8))}, {MODELOPT_NVFP4})")
    modules = sorted(k[: -len(".weight_scale")] for k in tensors if k.endswith(".weight_scale"))
    for module in modules:
        if _excluded(exclude, module):
            raise fail(method, f"{module!r} has quantization scales but is listed in 'exclude_modules'")
    if algo in MODELOPT_FP8:
        _fp8_pairs(method, tensors, "_scale", None, "modelopt fp8")
    else:
        if group not in (None, NVFP4_GROUP):
            raise fail(method, f"NVFP4 with group_size {group}, expected {NVFP4_GROUP}")
        for module in modules:
            tensors[f"{module}.weight"] = _modelopt_nvfp4(module, tensors)
    _unscaled_fp8(method, tensors)


def _modelopt_nvfp4(module: str, tensors: dict[str, Tensor]) -> QuantizedTensor:
    """``weight`` U8 ``[..., out, in/2]``, ``weight_scale`` F8 ``[..., out, in/16]`` and
    ``weight_scale_2`` (one value): ``fp4(q) · weight_scale · weight_scale_2``."""
    method, name = "modelopt", f"{module}.weight"
    scale = stored(method, f"{name}_scale", tensors.pop(f"{name}_scale"))
    second = tensors.pop(f"{name}_scale_2", None)
    weight = tensors.get(name)
    if second is None or not isinstance(weight, TensorInfo) or weight.dtype != np.uint8 or not _is_fp8(scale):
        found = "missing" if weight is None else f"{weight.dtype}"
        raise fail(method, f"NVFP4 {module!r} needs a U8 'weight' (found {found}), an FP8 'weight_scale' "
                            f"(found {scale.dtype}) and a 'weight_scale_2'")
    scale_2 = stored(method, f"{name}_scale_2", second)
    if math.prod(scale_2.shape) != 1:
        raise fail(method, f"{scale_2.name!r} has shape {list(scale_2.shape)}, expected one value")
    shape = (*weight.shape[:-1], weight.shape[-1] * 2)
    block = _fit_block((NVFP4_GROUP,), len(shape))
    fitted = _checked_scale(method, weight, scale, block, shape)
    scales = BlockScales(fitted, block, global_scale=scale_2._replace(shape=(1,)), global_multiplies=True)
    return QuantizedTensor(name, shape, PackedFp4Codes(weight), scales,
                           "modelopt nvfp4 (e2m1 codes, fp8 scale per 16, times weight_scale_2)")


HANDLERS: dict[str, Callable[[QuantConfig, dict[str, Tensor], ReadValues], None]] = {
    "awq": awq,
    "gptq": gptq,
    "fp8": _fp8,
    "modelopt": _modelopt,
    "fbgemm_fp8": _fbgemm_fp8,
    "mxfp4": _mxfp4,
    "compressed-tensors": _compressed_tensors,
}


def _quantization_config(config: Mapping[str, Any], hf_quant: object) -> tuple[str, object]:
    """Where the checkpoint's ``quantization_config`` is and its value: at the top, else in
    ``text_config`` (multimodal wrappers such as Kimi-K2.5 quantize only their language model), else
    ModelOpt's ``hf_quant_config.json`` (``hf_quant``, None when the checkpoint has none)."""
    if config.get("quantization_config") is not None:
        return "quantization_config", config["quantization_config"]
    text = config.get("text_config")
    if isinstance(text, Mapping) and text.get("quantization_config") is not None:
        return "text_config.quantization_config", text["quantization_config"]
    if hf_quant is not None:
        if not isinstance(hf_quant, Mapping):
            raise ConfigError(HF_QUANT_CONFIG, hf_quant, "an object", file=HF_QUANT_CONFIG)
        return HF_QUANT_CONFIG, {"quant_method": "modelopt", **hf_quant}
    return "quantization_config", None


def quantization_method(config: Mapping[str, Any], hf_quant: object = None) -> tuple[str | None, QuantConfig]:
    """``quantization_config.quant_method`` and the config itself, type-checked (``hf_quant``: the
    parsed ``hf_quant_config.json`` of a ModelOpt export, used when ``config.json`` has no
    ``quantization_config``)."""
    where, qc = _quantization_config(config, hf_quant)
    if qc is None:
        return None, {}
    if not isinstance(qc, Mapping):
        raise ConfigError(where, qc, "an object with a 'quant_method'")
    method = qc.get("quant_method")
    if not isinstance(method, str):
        raise ConfigError(f"{where}.quant_method", method, "a string")
    method = method.lower()
    if method in NOT_YET_SUPPORTED:
        raise UnsupportedQuantizationError(f"quantization method {method!r} is not supported yet "
                                           f"(supported: {', '.join(sorted(HANDLERS))})")
    if method not in HANDLERS:
        raise QuantizationError(f"unknown quantization method {method!r} (supported: {', '.join(sorted(HANDLERS))})")
    return method, qc


def dequantized_view(config: Mapping[str, Any], tensors: Mapping[str, TensorInfo], read: ReadValues,
                     hf_quant: object = None) -> QuantizedView:
    """The checkpoint's tensors as the model sees them: quantized weights decoded on read.

    ``read`` returns the values of small tensors (compressed-tensors' ``weight_shape``);
    ``hf_quant`` is the parsed ``hf_quant_config.json`` of a ModelOpt export, if it has one.
    """
    method, qc = quantization_method(config, hf_quant)
    activation = {k: v for k, v in tensors.items() if ACTIVATION.search(k)}
    work: dict[str, Tensor] = {k: v for k, v in tensors.items() if k not in activation}
    if method is None:
        _legacy_fp8(work)
    else:
        HANDLERS[method](qc, work, read)
    leftover = sorted(k for k, v in work.items() if isinstance(v, TensorInfo) and COMPANION.search(k))
    if leftover:
        more = f" and {len(leftover) - 5} more" if len(leftover) > 5 else ""
        shown = ", ".join(repr(k) for k in leftover[:5]) + more
        hint = ""
        if method is None and any(k.endswith(".weight_scale") for k in leftover):
            hint = (f" (an NVIDIA ModelOpt export describes its weight_scale tensors in {HF_QUANT_CONFIG} "
                    "beside config.json: is it missing?)")
        raise fail(method, f"{len(leftover)} quantization tensor(s) that no known layout explains: {shown}{hint}")
    return QuantizedView(work, method, activation)
