"""``compressed-tensors`` (llm-compressor): a ``config_groups`` entry per set of target modules.

- ``float-quantized`` / ``int-quantized``: ``weight`` F8/I8 + ``weight_scale`` per
  tensor/channel/group/block, optional ``weight_zero_point``;
- ``pack-quantized``: ``weight_packed`` I32 + ``weight_shape``, zero points packed along rows;
- ``nvfp4-pack-quantized``: ``weight_packed`` U8 + F8 ``weight_scale`` per 16 + ``weight_global_scale``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from otfload.errors import ConfigError, UnsupportedQuantizationError
from otfload.index.header import TensorInfo
from otfload.index.quant.codes import Codes, PackedFp4Codes, PackedIntCodes, PlainCodes
from otfload.index.quant.common import QuantConfig, ReadValues, Tensor, fail, stored
from otfload.index.quant.methods.scale_grid import NVFP4_GROUP, as_grid, checked_scale, fit_block, is_fp8, scale_grid
from otfload.index.quant.scales import BlockScales
from otfload.index.quant.tensor import QuantizedTensor


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
        return fit_block(self.block, len(shape))


def _targets_match(targets: object, module: str) -> bool:
    if not isinstance(targets, list):
        return False
    for target in targets:
        if not isinstance(target, str):
            continue
        if target == "Linear" or target == module or (target.startswith("re:") and re.match(target[3:], module)):
            return True
    return False


def compressed_tensors(qc: QuantConfig, tensors: dict[str, Tensor], read: ReadValues) -> None:
    """``quant_method: compressed-tensors``: every module with a ``weight_scale``, by the config group
    that targets it (one listed in ``ignore`` or targeted by none is an error)."""
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
        if not isinstance(weight, TensorInfo) or not (is_fp8(weight) or weight.dtype == np.int8):
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
    fitted = checked_scale(method, placeholder, scale, block, shape)
    zero_bits, fitted_zero = 0, None
    if zero is not None:
        grid = scale_grid(shape, block)
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
