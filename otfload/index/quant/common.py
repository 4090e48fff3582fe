"""What every quantization method's decoder shares: the tensor map it rewrites and its typed errors."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from otfload.errors import QuantizationError
from otfload.index.header import TensorInfo
from otfload.index.quant.tensor import QuantizedTensor

# A checkpoint tensor as a method's decoder sees it: stored, or already decoded.
Tensor = TensorInfo | QuantizedTensor
ReadValues = Callable[[list[TensorInfo]], list[np.ndarray]]
# A parsed ``quantization_config`` (JSON: values are checked where they are read).
QuantConfig = Mapping[str, Any]
# A method's decoder: replaces the stored parts of its quantized weights in the tensor map by
# QuantizedTensors (``ReadValues`` reads small tensors whose values the layout depends on).
Method = Callable[[QuantConfig, dict[str, Tensor], ReadValues], None]


def fail(method: str | None, message: str) -> QuantizationError:
    return QuantizationError(f"quantization {method or '(no quantization_config)'}: {message}")


def stored(method: str | None, key: str, tensor: Tensor) -> TensorInfo:
    """A companion of a quantized weight (scale, zero point, packed codes, ...) as it is stored.

    Only the weight a companion belongs to is decoded, never the companion itself: one that is
    already a :class:`QuantizedTensor` means two layouts claimed the same name."""
    if isinstance(tensor, TensorInfo):
        return tensor
    raise fail(method, f"{key!r} is both a decoded weight and a companion of one")
