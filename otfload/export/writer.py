"""Writing an HF checkpoint directory: safetensors shards, the index and ``config.json``, atomically.

Shards are filled in key order the way ``transformers``' ``save_pretrained`` does (a tensor larger
than ``max_shard_size`` gets a shard of its own) and named ``model-0000i-of-0000n.safetensors``;
one shard is written as ``model.safetensors`` with no index. Each tensor is produced on demand,
written and dropped, so the host holds one tensor at a time. Everything is written into a
temporary directory beside the target, which is renamed into place only when complete.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from otfload.index.dtypes import safetensors_name

INDEX_FILE = "model.safetensors.index.json"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class TensorSpec(NamedTuple):
    key: str
    shape: tuple[int, ...]
    dtype: np.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def parse_size(size: int | str) -> int:
    """``5GB`` → 5·10⁹ bytes, ``1GiB`` → 2³⁰ (the units ``save_pretrained`` accepts); ints pass through."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", size.upper())
    if m is None:
        raise ValueError(f"max_shard_size {size!r} is not a size such as '5GB' or '500MiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def natural_key(key: str) -> list:
    """Sort key ordering ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def split_shards(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors into shards of at most ``max_bytes`` (oversized tensors alone), in order."""
    shards, current, size = [], [], 0
    for spec in specs:
        if spec.nbytes > max_bytes:
            shards.append([spec])
            continue
        if current and size + spec.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    return [*shards, current] if current else shards


def _header(specs: Sequence[TensorSpec]) -> bytes:
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for spec in specs:
        header[spec.key] = {"dtype": safetensors_name(spec.dtype), "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def write_safetensors(path: Path, specs: Sequence[TensorSpec], produce: Callable[[str], np.ndarray]) -> None:
    """Write one safetensors file, asking ``produce(key)`` for each tensor in turn."""
    header = _header(specs)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for spec in specs:
            array = np.ascontiguousarray(produce(spec.key))
            if array.shape != spec.shape or array.dtype != spec.dtype:
                raise ValueError(f"{spec.key}: produced {array.dtype}{list(array.shape)}, "
                                 f"planned {spec.dtype}{list(spec.shape)}")
            f.write(array.reshape(-1).view(np.uint8).data)
            del array


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def write_shards(
    out: Path, specs: Sequence[TensorSpec], produce: Callable[[str], np.ndarray], max_shard_size: int | str
) -> None:
    """All shards plus ``model.safetensors.index.json`` (when there is more than one shard)."""
    shards = split_shards(specs, parse_size(max_shard_size))
    names = shard_names(len(shards))
    for name, shard in zip(names, shards, strict=True):
        write_safetensors(out / name, shard, produce)
    if len(shards) > 1:
        index = {
            "metadata": {"total_parameters": sum(math.prod(s.shape) for s in specs),
                         "total_size": sum(s.nbytes for s in specs)},
            "weight_map": {s.key: name for name, shard in zip(names, shards, strict=True) for s in shard},
        }
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


def write_config(out: Path, config: Mapping) -> None:
    (out / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``target``; on success it replaces ``target``, on
    failure it is removed (``target`` is never left half-written)."""
    target = Path(target).absolute()
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
        target.rename(old)
        tmp.rename(target)
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        tmp.rename(target)
