"""Safetensors dtype strings and their numpy (ml_dtypes) equivalents."""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

SAFETENSORS_DTYPES: dict[str, np.dtype[Any]] = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.int8),
    "U16": np.dtype(np.uint16),
    "I16": np.dtype(np.int16),
    "U32": np.dtype(np.uint32),
    "I32": np.dtype(np.int32),
    "U64": np.dtype(np.uint64),
    "I64": np.dtype(np.int64),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F32": np.dtype(np.float32),
    "F64": np.dtype(np.float64),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    # UE8M0 (``2**(s - 127)``, 255 NaN): block scales of DeepSeek-V4's FP8 and FP4 weights
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
}

_NAME_BY_DTYPE = {dt: name for name, dt in SAFETENSORS_DTYPES.items()}

# Names users write for ``dtype=`` arguments.
_USER_DTYPES = {
    "bf16": "BF16", "bfloat16": "BF16", "f32": "F32", "float32": "F32", "fp32": "F32",
    "f16": "F16", "float16": "F16", "fp16": "F16", "f64": "F64", "float64": "F64",
}


def safetensors_name(dtype: npt.DTypeLike) -> str:
    """The safetensors dtype string of a numpy dtype."""
    try:
        return _NAME_BY_DTYPE[np.dtype(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors equivalent") from None


def to_numpy_dtype(dtype: npt.DTypeLike) -> np.dtype[Any]:
    """Accept numpy/jax dtypes and names such as ``"bf16"``, ``"float32"``, ``"BF16"``."""
    if isinstance(dtype, str):
        key = _USER_DTYPES.get(dtype.lower(), dtype.upper())
        if key in SAFETENSORS_DTYPES:
            return SAFETENSORS_DTYPES[key]
    return np.dtype(dtype)
