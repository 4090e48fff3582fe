"""The scale grid of a quantized weight: one scale per block of elements, checked against the shape
of the weight it scales (the grid may add or drop size-1 axes; a scale that does not fit is an error,
never dropped)."""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np

from otfload.index.header import TensorInfo
from otfload.index.quant.codecs import cast, e8m0
from otfload.index.quant.common import Tensor, fail

# NVFP4 shares one FP8 scale between 16 FP4 values (the format fixes it).
NVFP4_GROUP = 16
# The dtype of UE8M0 scales (``2**(s - 127)``): DeepSeek-V4's ``.scale`` tensors.
E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)
# The FP8 dtypes of values (compared as dtypes: ``dtype.name`` costs microseconds, and a large
# checkpoint asks for 10^5 of them).
FP8_DTYPES = frozenset(np.dtype(getattr(ml_dtypes, name)) for name in dir(ml_dtypes)
                       if name.startswith("float8_") and name != "float8_e8m0fnu")


def as_grid(info: TensorInfo, grid: tuple[int, ...]) -> TensorInfo | None:
    """``info`` viewed with shape ``grid`` when that only adds or drops size-1 axes (same bytes)."""
    squeeze = tuple(d for d in info.shape if d != 1)
    if math.prod(info.shape) != math.prod(grid) or squeeze != tuple(d for d in grid if d != 1):
        return None
    return info._replace(shape=grid)


def scale_grid(shape: tuple[int, ...], block: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the scale grid of a tensor of ``shape`` in blocks of ``block`` (partial blocks count)."""
    return tuple(-(-d // b) for d, b in zip(shape, block, strict=True))


def fit_block(block: tuple[int, ...], ndim: int) -> tuple[int, ...]:
    """A block over the last ``len(block)`` axes, one element along any leading (expert) axes."""
    return (1,) * (ndim - len(block)) + block


def checked_scale(method: str | None, weight: Tensor, scale: TensorInfo, block: tuple[int, ...],
                  shape: tuple[int, ...] | None = None) -> TensorInfo:
    """``scale`` viewed as the scale grid of ``weight`` (or of ``shape``) in blocks of ``block``: a
    :class:`QuantizationError` when its shape does not fit or its dtype is not a float."""
    shape = shape or weight.shape
    grid = scale_grid(shape, block)
    fitted = as_grid(scale, grid)
    if fitted is None:
        raise fail(method, f"scale {scale.name!r} has shape {list(scale.shape)}; weight {weight.name!r} "
                            f"{list(shape)} with blocks {list(block)} needs {list(grid)}")
    if scale.dtype.kind not in "fV":  # a numpy float, or an ml_dtypes one (bfloat16, FP8)
        raise fail(method, f"scale {scale.name!r} has dtype {scale.dtype}, expected a float dtype")
    return fitted


def is_fp8(info: TensorInfo) -> bool:
    """Whether ``info`` is stored in an FP8 dtype of values (not UE8M0, which holds scales only)."""
    return info.dtype in FP8_DTYPES


def is_e8m0(info: TensorInfo) -> bool:
    """Whether ``info`` is stored as UE8M0 scales (``float8_e8m0fnu``)."""
    return bool(info.dtype == E8M0)


def scale_part(scale: TensorInfo) -> tuple[TensorInfo, str]:
    """A scale tensor as it is read and the codec that decodes it: UE8M0 bytes as uint8 through
    ``e8m0`` (the same bytes: exact on the host and the devices), any float dtype as stored through
    ``cast``."""
    if is_e8m0(scale):
        return scale._replace(dtype=np.dtype(np.uint8)), e8m0.CODEC.name
    return scale, cast.CODEC.name
