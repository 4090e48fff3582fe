"""Checkpoints at a published model's full size with headers only: every safetensors file holds a
real header and a sparse (unwritten) data section of the right length, so planning (``otfload
inspect``, :func:`otfload.plan_model`) reads what it would from the real files, without the bytes."""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Mapping
from pathlib import Path

# safetensors dtype -> bytes per element
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4, "F8_E4M3": 1, "I32": 4, "U8": 1}
Spec = tuple[str, tuple[int, ...]]  # (safetensors dtype, shape)


def write_header_checkpoint(path: Path, shards: Mapping[str, Mapping[str, Spec]], config: dict) -> Path:
    """``path`` with one sparse safetensors file per ``shards`` entry (file name -> {key: (dtype, shape)}),
    the index and ``config.json``."""
    path.mkdir(parents=True, exist_ok=True)
    weight_map, total = {}, 0
    for name, tensors in shards.items():
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for key, (dtype, shape) in tensors.items():
            size = math.prod(shape) * ITEMSIZE[dtype]
            header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
            offset += size
            weight_map[key] = name
        blob = json.dumps(header).encode()
        blob += b" " * (-len(blob) % 8)
        with open(path / name, "wb") as f:
            f.write(struct.pack("<Q", len(blob)) + blob)
            f.truncate(8 + len(blob) + offset)
        total += offset
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
    (path / "config.json").write_text(json.dumps(config))
    return path


def fp8_linear(key: str, out: int, inp: int, block: tuple[int, int] = (128, 128)) -> dict[str, Spec]:
    """An FP8 block-scaled linear weight ``[out, in]`` and its float32 ``weight_scale_inv`` grid."""
    return {key: ("F8_E4M3", (out, inp)),
            f"{key}_scale_inv": ("F32", (-(-out // block[0]), -(-inp // block[1])))}
