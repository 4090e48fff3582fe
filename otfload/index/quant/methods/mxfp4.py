"""``mxfp4`` (GPT-OSS): ``X_blocks`` U8 ``[..., out, in/32, 16]`` (FP4 E2M1, two per byte) +
``X_scales`` U8 ``[..., out, in/32]`` (E8M0), standing for ``X`` ``[..., in, out]``."""

from __future__ import annotations

import numpy as np

from otfload.index.quant.codes import MX_BLOCK, MX_BLOCK_BYTES, Mxfp4Codes
from otfload.index.quant.common import QuantConfig, ReadValues, Tensor, fail, stored
from otfload.index.quant.tensor import QuantizedTensor


def mxfp4(qc: QuantConfig, tensors: dict[str, Tensor], _read: ReadValues) -> None:
    """``quant_method: mxfp4``: every ``X_blocks`` with its ``X_scales`` decoded as ``X``."""
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
