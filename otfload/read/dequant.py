"""FP8 block-scaled dequantisation, applied while reading (DeepSeek-V3's published format).

A quantised weight ``W`` (``float8_e4m3fn``, shape ``[rows, cols]``) comes with
``W_scale_inv`` (float32, ``[ceil(rows/B), ceil(cols/B)]``, ``B`` = 128 by default): element
``(r, c)`` is ``W[r, c] * scale_inv[r // B, c // B]``. A shard reads its box of ``W`` and only the
block rows/columns of the scale that cover it, so dequantisation is as local as the read; no
dequantised copy of anything but the shard's own slice ever exists.
"""

from __future__ import annotations

import numpy as np

from otfload.plan.boxes import Box


def scale_box(box: Box, block: tuple[int, int]) -> Box:
    """The box of the scale tensor whose blocks cover ``box`` of the weight."""
    return tuple((start // b, -(-stop // b)) for (start, stop), b in zip(box, block, strict=True))


def dequantize(weight: np.ndarray, box: Box, scales: np.ndarray, block: tuple[int, int]) -> np.ndarray:
    """``weight`` (the ``box`` of an FP8 tensor) times its block scales, as float32."""
    out = weight.astype(np.float32)
    for axis, ((start, stop), b) in enumerate(zip(box, block, strict=True)):
        expanded = np.repeat(scales, b, axis=axis)
        offset = start - (start // b) * b
        index = [slice(None)] * scales.ndim
        index[axis] = slice(offset, offset + stop - start)
        scales = expanded[tuple(index)]
    return out * scales
