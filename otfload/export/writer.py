"""Writing an HF checkpoint directory: safetensors shards, the index and ``config.json``, atomically.

Shards are filled in key order the way ``transformers``' ``save_pretrained`` does (a tensor larger
than ``max_shard_size`` gets a shard of its own) and named ``model-0000i-of-0000n.safetensors``;
one shard is written as ``model.safetensors`` with no index. Each tensor is produced on demand,
written and dropped, so the host holds one tensor at a time (a bar on stderr counts the bytes
written, :func:`write_progress`); :class:`ShardFiles` lays the files
out first so tensors can also be written in any order. Everything is written into a temporary
directory beside the target, which is renamed into place only when complete (:mod:`otfload.atomic`).
"""

from __future__ import annotations

import json
import math
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from tqdm import tqdm

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


def natural_key(key: str) -> list[int | str]:
    """Sort key ordering ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", key)]


def split_shards(specs: Sequence[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """Group tensors into shards of at most ``max_bytes`` (oversized tensors alone), in order."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
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
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for spec in specs:
        header[spec.key] = {"dtype": safetensors_name(spec.dtype), "shape": list(spec.shape),
                            "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _check(spec: TensorSpec, array: np.ndarray) -> None:
    if array.shape != spec.shape or array.dtype != spec.dtype:
        raise ValueError(
            f"{spec.key}: produced {array.dtype}{list(array.shape)}, planned {spec.dtype}{list(spec.shape)}"
        )


def write_safetensors(path: Path, specs: Sequence[TensorSpec], produce: Callable[[str], np.ndarray],
                      written: Callable[[int], object] = lambda nbytes: None) -> None:
    """Write one safetensors file, asking ``produce(key)`` for each tensor in turn; ``written(nbytes)``
    after each (a progress bar's ``update``)."""
    header = _header(specs)
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little"))
        f.write(header)
        for spec in specs:
            array = np.ascontiguousarray(produce(spec.key))
            _check(spec, array)
            f.write(array.reshape(-1).view(np.uint8).data)
            del array
            written(spec.nbytes)


def write_progress(total: int, show: bool | None) -> tqdm[Any]:
    """The bar of an export's writes: ``total`` bytes on stderr, shown when ``show`` (``None``: when
    stderr is a terminal, as the load's bar)."""
    shown = sys.stderr.isatty() if show is None else show
    return tqdm(total=total, unit="B", unit_scale=True, desc="otfload export", disable=not shown, file=sys.stderr)


def shard_names(count: int) -> list[str]:
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def plan_shards(specs: Sequence[TensorSpec], max_shard_size: int | str) -> dict[str, list[TensorSpec]]:
    """File name → the tensors it holds, in the order and split ``save_pretrained`` uses."""
    shards = split_shards(specs, parse_size(max_shard_size))
    return dict(zip(shard_names(len(shards)), shards, strict=True))


def write_index(out: Path, files: Mapping[str, Sequence[TensorSpec]]) -> None:
    """``model.safetensors.index.json`` for ``files`` (nothing when there is a single file)."""
    if len(files) < 2:
        return
    specs = [s for shard in files.values() for s in shard]
    index = {
        "metadata": {"total_parameters": sum(math.prod(s.shape) for s in specs),
                     "total_size": sum(s.nbytes for s in specs)},
        "weight_map": {s.key: name for name, shard in files.items() for s in shard},
    }
    (out / INDEX_FILE).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")


class ShardFiles:
    """Shard files laid out up front — headers written, each file at its full size — so tensors
    can be written in any order (:meth:`write` places one at its offset)."""

    def __init__(self, out: Path, specs: Sequence[TensorSpec], max_shard_size: int | str,
                 written: Callable[[int], object] = lambda nbytes: None):
        self.out = out
        self._written_bytes = written
        self.files = plan_shards(specs, max_shard_size)
        self._where: dict[str, tuple[Path, int, TensorSpec]] = {}
        self._written: set[str] = set()
        for name, shard in self.files.items():
            header = _header(shard)
            offset = 8 + len(header)
            with open(out / name, "wb") as f:
                f.write(len(header).to_bytes(8, "little"))
                f.write(header)
                f.truncate(offset + sum(s.nbytes for s in shard))
            for spec in shard:
                self._where[spec.key] = (out / name, offset, spec)
                offset += spec.nbytes

    def write(self, key: str, array: np.ndarray) -> None:
        """Write tensor ``key`` (shape and dtype as planned) at its place in its file."""
        path, offset, spec = self._where[key]
        array = np.ascontiguousarray(array)
        _check(spec, array)
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(array.reshape(-1).view(np.uint8).data)
        self._written.add(key)
        self._written_bytes(spec.nbytes)

    def finish(self) -> None:
        """Write the index; ``ValueError`` if a planned tensor was never written."""
        missing = sorted(set(self._where) - self._written)
        if missing:
            raise ValueError(f"tensors {missing} were planned but never written")
        write_index(self.out, self.files)


def write_config(out: Path, config: Mapping[str, Any]) -> None:
    (out / "config.json").write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
