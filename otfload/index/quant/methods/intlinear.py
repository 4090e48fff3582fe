"""GPTQ and AWQ: integer codes packed into int32 words, stored ``[in, out]``-major.

Both formats store, per linear module ``m`` (the HF weight ``W`` is ``[out, in]``), codes ``q``,
one scale ``s`` and one zero point ``z`` per group of ``group_size`` input columns, and give
``W[o, i] = (q[i, o] - z[g(i), o]) · s[g(i), o]``:

- **GPTQ** (AutoGPTQ, GPTQModel, optimum): ``m.qweight`` I32 ``[in·b/32, out]`` (input rows packed
  ``32/b`` per word, row ``r`` of a word in bits ``[r·b, (r+1)·b)``), ``m.qzeros`` I32
  ``[groups, out·b/32]`` (packed the same way along the output), ``m.scales`` F16 ``[groups, out]``,
  ``m.g_idx`` I32 ``[in]``: the group of each input row. ``desc_act: false`` means
  ``g(i) = i // group_size`` (``g_idx`` is that by construction and is not read); with
  ``desc_act: true`` the rows were quantized in activation order and ``g_idx`` is read for each
  box. ``checkpoint_format: "gptq"`` (v1, the default) stores every zero point minus one, ``gptq_v2``
  as it is. ``group_size: -1`` is one group over all inputs. 2, 4 and 8 bits (3-bit words straddle).
- **AWQ** (AutoAWQ ``version: "gemm"``): ``m.qweight`` I32 ``[in, out/8]`` and ``m.qzeros`` I32
  ``[in/group, out/8]``, 8 int4 values per word along the output **interleaved**: output column
  ``8w + j`` is field ``(0, 4, 1, 5, 2, 6, 3, 7)[j]`` of word ``w``; ``m.scales`` F16 ``[in/group, out]``.

Seen in ``W``'s orientation (:attr:`QuantizedTensor.transposed`), GPTQ is compressed-tensors'
asymmetric ``pack-quantized`` layout (codes packed along the input, zero points along the output
rows) and AWQ the same with its codes packed along the output rows; so both decode per device box
with the same code, and keep packed with ``quantized="keep"`` (except ``desc_act: true``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from otfload.errors import ConfigError, UnsupportedQuantizationError
from otfload.index.header import TensorInfo
from otfload.index.quant.codecs.packed_int import BITS_PER_WORD
from otfload.index.quant.codes import PackedIntCodes
from otfload.index.quant.common import QuantConfig, ReadValues, Tensor, fail, stored
from otfload.index.quant.scales import BlockScales, IndexedScales
from otfload.index.quant.tensor import QuantizedTensor

# Bit widths whose fields tile an int32 word (GPTQ's 3-bit words straddle fields across words).
GPTQ_BITS = (2, 4, 8)
AWQ_BITS = 4
# AWQ's interleave: element ``j`` of each word is field ``AWQ_ORDER[j]`` (AutoAWQ packs column
# ``(0, 2, 4, 6, 1, 3, 5, 7)[k]`` into field ``k``; this is its inverse).
AWQ_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
# What each GPTQ ``checkpoint_format`` adds to a stored zero point (v1 stores them minus one).
GPTQ_ZERO_ADD = {"gptq": 1, "gptq_v2": 0}
AWQ_VERSIONS = ("gemm",)
# ``group_size`` of one group over every input column.
WHOLE_ROW = -1


@dataclass(frozen=True)
class IntArgs:
    """The parameters of a GPTQ or AWQ ``quantization_config``."""

    bits: int
    group_size: int  # WHOLE_ROW: one group per output column
    desc_act: bool = False
    zero_add: int = 0

    def groups(self, columns: int) -> int:
        return 1 if self.group_size == WHOLE_ROW else -(-columns // self.group_size)


def _field(qc: QuantConfig, names: tuple[str, ...], default: Any = None) -> tuple[str, Any]:
    name = next((n for n in names if n in qc), names[0])
    return f"quantization_config.{name}", qc.get(name, default)


def _group_size(qc: QuantConfig) -> int:
    where, group = _field(qc, ("group_size", "q_group_size"), 128)
    if type(group) is not int or not (group > 0 or group == WHOLE_ROW):
        raise ConfigError(where, group, "a positive int or -1")
    return group


def gptq_args(qc: QuantConfig) -> IntArgs:
    where, bits = _field(qc, ("bits",), 4)
    if type(bits) is not int:
        raise ConfigError(where, bits, "an int")
    if bits not in GPTQ_BITS:
        raise UnsupportedQuantizationError(f"gptq: {bits}-bit codes are not supported yet (supported: {GPTQ_BITS})")
    flags = {}
    for name, default in (("desc_act", False), ("sym", True), ("is_marlin_format", False)):
        value = qc.get(name, default)
        if not isinstance(value, bool):
            raise ConfigError(f"quantization_config.{name}", value, "a bool")
        flags[name] = value
    where, fmt = _field(qc, ("checkpoint_format", "format"), "gptq")
    if not isinstance(fmt, str):
        raise ConfigError(where, fmt, "a string")
    if qc.get("dynamic"):
        raise UnsupportedQuantizationError("gptq: per-module overrides (quantization_config.dynamic) are not "
                                           "supported yet")
    if flags["is_marlin_format"] or fmt.lower() not in GPTQ_ZERO_ADD:
        raise UnsupportedQuantizationError(f"gptq: checkpoint format {fmt!r}{' (marlin)' * flags['is_marlin_format']}"
                                           f" is not supported yet (supported: {', '.join(GPTQ_ZERO_ADD)})")
    return IntArgs(bits, _group_size(qc), flags["desc_act"], GPTQ_ZERO_ADD[fmt.lower()])


def awq_args(qc: QuantConfig) -> IntArgs:
    where, bits = _field(qc, ("bits", "w_bit"), AWQ_BITS)
    if bits != AWQ_BITS or type(bits) is not int:
        raise UnsupportedQuantizationError(f"awq: {where} = {bits!r}: only {AWQ_BITS}-bit AWQ is supported")
    where, version = _field(qc, ("version", "format"), "gemm")
    if not isinstance(version, str) or version.lower() not in AWQ_VERSIONS:
        raise UnsupportedQuantizationError(f"awq: {where} = {version!r} is not supported yet "
                                           f"(supported: {', '.join(AWQ_VERSIONS)})")
    zero_point = qc.get("zero_point", True)
    if zero_point is not True:
        raise UnsupportedQuantizationError(f"awq: quantization_config.zero_point = {zero_point!r}: only AWQ "
                                           "with zero points is supported")
    return IntArgs(AWQ_BITS, _group_size(qc))


def _parts(method: str, module: str, tensors: dict[str, Tensor]) -> dict[str, TensorInfo]:
    """The stored ``qweight``, ``qzeros``, ``scales`` (and ``g_idx``) of ``module``, taken out of ``tensors``."""
    if f"{module}.weight" in tensors:
        raise fail(method, f"{module!r} has both 'weight' and 'qweight'")
    found = {}
    for role in ("qweight", "qzeros", "scales", "g_idx"):
        tensor = tensors.pop(f"{module}.{role}", None)
        if tensor is not None:
            found[role] = stored(method, f"{module}.{role}", tensor)
    missing = [r for r in ("qzeros", "scales") if r not in found]
    if missing:
        raise fail(method, f"{module!r} has a qweight but no {' or '.join(missing)}")
    for role in ("qweight", "qzeros", "g_idx"):
        info = found.get(role)
        if info is not None and info.dtype != np.int32:
            raise fail(method, f"{info.name!r} has dtype {info.dtype}, expected I32")
    if not np.issubdtype(found["scales"].dtype, np.floating) and found["scales"].dtype.kind != "V":
        raise fail(method, f"{found['scales'].name!r} has dtype {found['scales'].dtype}, expected a float dtype")
    return found


def _check_shapes(method: str, parts: dict[str, TensorInfo], expected: dict[str, tuple[int, ...]]) -> None:
    for role, shape in expected.items():
        info = parts.get(role)
        if info is not None and info.shape != shape:
            raise fail(method, f"{info.name!r} has shape {list(info.shape)}, expected {list(shape)} "
                               f"(from {parts['qweight'].name!r} {list(parts['qweight'].shape)})")


def _gptq_weight(module: str, args: IntArgs, tensors: dict[str, Tensor]) -> QuantizedTensor:
    method = "gptq"
    parts = _parts(method, module, tensors)
    per = BITS_PER_WORD // args.bits
    qweight = parts["qweight"]
    if len(qweight.shape) != 2:
        raise fail(method, f"{qweight.name!r} has shape {list(qweight.shape)}, expected [in*bits/32, out]")
    columns, out = qweight.shape[0] * per, qweight.shape[1]
    groups = args.groups(columns)
    _check_shapes(method, parts, {"scales": (groups, out), "qzeros": (groups, -(-out // per)),
                                  "g_idx": (columns,)})
    codes = PackedIntCodes(qweight, args.bits)
    scales: BlockScales | IndexedScales
    if args.desc_act:
        if "g_idx" not in parts:
            raise fail(method, f"{module!r} has desc_act true but no g_idx")
        scales = IndexedScales(parts["scales"], groups, parts["g_idx"], parts["qzeros"], args.bits, args.zero_add)
        order = "g_idx order"
    else:
        block = (1, columns if args.group_size == WHOLE_ROW else args.group_size)
        scales = BlockScales(parts["scales"], block, parts["qzeros"], args.bits, zero_point_add=args.zero_add)
        order = f"groups of {block[1]}"
    return QuantizedTensor(f"{module}.weight", (out, columns), codes, scales,
                           f"gptq int{args.bits}, {order}, {parts['scales'].dtype.name} scales", transposed=True)


def _awq_weight(module: str, args: IntArgs, tensors: dict[str, Tensor]) -> QuantizedTensor:
    method = "awq"
    parts = _parts(method, module, tensors)
    if "g_idx" in parts:
        raise fail(method, f"{parts['g_idx'].name!r}: AWQ has no g_idx")
    qweight = parts["qweight"]
    per = BITS_PER_WORD // args.bits
    if len(qweight.shape) != 2:
        raise fail(method, f"{qweight.name!r} has shape {list(qweight.shape)}, expected [in, out/8]")
    columns, out = qweight.shape[0], qweight.shape[1] * per
    groups = args.groups(columns)
    _check_shapes(method, parts, {"scales": (groups, out), "qzeros": (groups, qweight.shape[1])})
    block = (1, columns if args.group_size == WHOLE_ROW else args.group_size)
    codes = PackedIntCodes(qweight, args.bits, axis=-2, order=AWQ_ORDER)
    scales = BlockScales(parts["scales"], block, parts["qzeros"], args.bits, zero_point_order=AWQ_ORDER)
    return QuantizedTensor(f"{module}.weight", (out, columns), codes, scales,
                           f"awq int4 gemm, groups of {block[1]}, {parts['scales'].dtype.name} scales", transposed=True)


def _modules(tensors: dict[str, Tensor]) -> list[str]:
    return sorted(k[: -len(".qweight")] for k in tensors if k.endswith(".qweight"))


def gptq(qc: QuantConfig, tensors: dict[str, Tensor], _read: ReadValues) -> None:
    args = gptq_args(qc)
    for module in _modules(tensors):
        tensors[f"{module}.weight"] = _gptq_weight(module, args, tensors)


def awq(qc: QuantConfig, tensors: dict[str, Tensor], _read: ReadValues) -> None:
    args = awq_args(qc)
    for module in _modules(tensors):
        tensors[f"{module}.weight"] = _awq_weight(module, args, tensors)
