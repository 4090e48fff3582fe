"""``modelopt`` (NVIDIA ModelOpt): ``hf_quant_config.json`` beside ``config.json``, or a
``quantization_config`` with ``quant_method: modelopt``.

FP8 ``weight`` + ``weight_scale`` per tensor or per row; NVFP4 ``weight`` U8 (two E2M1 codes per
byte) + F8 ``weight_scale`` per 16 + ``weight_scale_2`` (one value that *multiplies*, where
compressed-tensors' global scale divides).
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Mapping

import numpy as np

from otfload.errors import ConfigError, UnsupportedQuantizationError
from otfload.index.header import TensorInfo
from otfload.index.quant.codes import PackedFp4Codes
from otfload.index.quant.common import QuantConfig, ReadValues, Tensor, fail, stored
from otfload.index.quant.methods.fp8 import fp8_pairs, unscaled_fp8
from otfload.index.quant.methods.scale_grid import NVFP4_GROUP, checked_scale, fit_block, is_fp8
from otfload.index.quant.scales import BlockScales
from otfload.index.quant.tensor import QuantizedTensor

# ModelOpt's ``quant_algo`` values decoded here, by the codes they store.
MODELOPT_FP8 = frozenset({"FP8", "FP8_PER_CHANNEL_PER_TOKEN"})


MODELOPT_NVFP4 = "NVFP4"


# The file ModelOpt exports write beside config.json (older exports: instead of quantization_config).
HF_QUANT_CONFIG = "hf_quant_config.json"


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


def modelopt(qc: QuantConfig, tensors: dict[str, Tensor], _read: ReadValues) -> None:
    """``quant_method: modelopt``: FP8 or NVFP4 by ``quant_algo``."""
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
        fp8_pairs(method, tensors, "_scale", None, "modelopt fp8")
    else:
        if group not in (None, NVFP4_GROUP):
            raise fail(method, f"NVFP4 with group_size {group}, expected {NVFP4_GROUP}")
        for module in modules:
            tensors[f"{module}.weight"] = _modelopt_nvfp4(module, tensors)
    unscaled_fp8(method, tensors)


def _modelopt_nvfp4(module: str, tensors: dict[str, Tensor]) -> QuantizedTensor:
    """``weight`` U8 ``[..., out, in/2]``, ``weight_scale`` F8 ``[..., out, in/16]`` and
    ``weight_scale_2`` (one value): ``fp4(q) · weight_scale · weight_scale_2``."""
    method, name = "modelopt", f"{module}.weight"
    scale = stored(method, f"{name}_scale", tensors.pop(f"{name}_scale"))
    second = tensors.pop(f"{name}_scale_2", None)
    weight = tensors.get(name)
    if second is None or not isinstance(weight, TensorInfo) or weight.dtype != np.uint8 or not is_fp8(scale):
        found = "missing" if weight is None else f"{weight.dtype}"
        raise fail(method, f"NVFP4 {module!r} needs a U8 'weight' (found {found}), an FP8 'weight_scale' "
                            f"(found {scale.dtype}) and a 'weight_scale_2'")
    scale_2 = stored(method, f"{name}_scale_2", second)
    if math.prod(scale_2.shape) != 1:
        raise fail(method, f"{scale_2.name!r} has shape {list(scale_2.shape)}, expected one value")
    shape = (*weight.shape[:-1], weight.shape[-1] * 2)
    block = fit_block((NVFP4_GROUP,), len(shape))
    fitted = checked_scale(method, weight, scale, block, shape)
    scales = BlockScales(fitted, block, global_scale=scale_2._replace(shape=(1,)), global_multiplies=True)
    return QuantizedTensor(name, shape, PackedFp4Codes(weight), scales,
                           "modelopt nvfp4 (e2m1 codes, fp8 scale per 16, times weight_scale_2)")
