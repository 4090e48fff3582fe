"""What a checkpoint holds: its config and, for every tensor, the file and byte span it lives in.

Only headers and small JSON files are read here. ``model.safetensors.index.json`` is validated
before any header is read: every file it names must be a plain name inside the checkpoint and
exist, and every tensor it lists must be found in exactly the file it names.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from otfload.errors import CheckpointIndexError
from otfload.gcpause import gc_paused
from otfload.index.derived import DerivedTensor
from otfload.index.header import FileHeader, TensorInfo, read_header, reject_duplicate_keys
from otfload.index.quant import dequantized_view
from otfload.index.quant.methods.modelopt import HF_QUANT_CONFIG
from otfload.sources.base import Source, read_bytes
from otfload.sources.checkpoint_files import is_checkpoint_file
from otfload.sources.load_context import map_in_context
from otfload.sources.names import check_member_name, checked_listing

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
# Headers are small; reading several at once hides remote latency without flooding a server.
HEADER_READ_THREADS = 8
# config.json and the index are small; anything larger is not what it claims to be.
MAX_JSON_FILE_BYTES = 64 * 1024 * 1024


@dataclass
class CheckpointIndex:
    """Config and tensor locations of one checkpoint, built from headers alone.

    ``tensors`` holds what the model sees: a quantized weight is one
    :class:`~otfload.index.quant.QuantizedTensor` (decoded on read) in place of its stored parts, and
    a weight with LoRA adapters merged in an :class:`~otfload.adapters.tensor.AdaptedTensor` (both
    :class:`~otfload.index.derived.DerivedTensor`);
    ``activation`` holds the activation-side scales (``input_scale``, ``k_scale``, ...), which no
    weight uses. ``source`` is None for an index kept after its load (a kept-LoRA model's record).
    """

    source: Source | None
    config: dict[str, Any]
    tensors: dict[str, TensorInfo | DerivedTensor]
    headers: dict[str, FileHeader] = field(repr=False)
    quant_method: str | None = None
    activation: dict[str, TensorInfo] = field(default_factory=dict, repr=False)

    @property
    def files(self) -> list[str]:
        return list(self.headers)

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def __getitem__(self, key: str) -> TensorInfo | DerivedTensor:
        return self.tensors[key]


def read_json(source: Source, file: str) -> object:
    """Parse a small JSON file of the checkpoint, with a typed error naming it."""
    size = source.size(file)
    if size > MAX_JSON_FILE_BYTES:
        raise CheckpointIndexError(f"{file}: {size} bytes is too large for a JSON file of a checkpoint")
    try:
        return json.loads(read_bytes(source, file).decode("utf-8"), object_pairs_hook=reject_duplicate_keys)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CheckpointIndexError(f"{file}: not valid JSON ({e})") from None


def _check_member_name(name: object, source: Source) -> str:
    name = check_member_name(name, f"{INDEX_FILE} in {source.description}", CheckpointIndexError)
    if not name.endswith(".safetensors"):
        raise CheckpointIndexError(f"{INDEX_FILE}: file {name!r} is not a .safetensors file")
    return name


def _weight_map(source: Source, available: set[str]) -> dict[str, str]:
    index = read_json(source, INDEX_FILE)
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise CheckpointIndexError(f"{INDEX_FILE}: no 'weight_map' object")
    if not weight_map:
        raise CheckpointIndexError(f"{INDEX_FILE}: 'weight_map' is empty")
    out = {}
    checked: set[str] = set()  # a few hundred files for ~100k tensors: each name checked once
    for key, file in weight_map.items():
        if not (isinstance(file, str) and file in checked):
            file = _check_member_name(file, source)
            if file not in available:
                raise CheckpointIndexError(f"{INDEX_FILE}: tensor {key!r} maps to missing file {file!r}")
            checked.add(file)
        out[key] = file
    return out


def _safetensors_files(source: Source, available: set[str]) -> tuple[list[str], dict[str, str] | None]:
    if INDEX_FILE in available:
        weight_map = _weight_map(source, available)
        return sorted(set(weight_map.values())), weight_map
    if SINGLE_FILE in available:
        return [SINGLE_FILE], None
    files = sorted(f for f in available if f.endswith(".safetensors") and "/" not in f)
    if not files:
        raise CheckpointIndexError(f"no .safetensors files in {source.description}")
    return files, None


def _merge(headers: dict[str, FileHeader], weight_map: dict[str, str] | None) -> dict[str, TensorInfo]:
    tensors: dict[str, TensorInfo] = {}
    for header in headers.values():
        for key, info in header.tensors.items():
            if key in tensors:
                raise CheckpointIndexError(f"tensor {key!r} is stored in both {tensors[key].file} and {info.file}")
            if weight_map is None or weight_map.get(key) == info.file:
                tensors[key] = info
    if weight_map is not None:
        for key, file in weight_map.items():
            if key not in tensors:
                raise CheckpointIndexError(f"{INDEX_FILE}: tensor {key!r} is not in {file}")
    return tensors


def open_index(source: Source, *, require_config: bool = True,
               check_config: Callable[[dict[str, Any]], object] | None = None) -> CheckpointIndex:
    """Read ``config.json``, the shard index and every safetensors header of ``source``.

    ``check_config`` (the API passes the family lookup) sees ``config.json`` before any header is
    read or any quantized layout decoded, so an unsupported model type is the error a user meets
    first, not a quantization layout its family would have explained.
    """
    with gc_paused():  # every record made here lives as long as the index
        return _open_index(source, require_config, check_config)


def _open_index(source: Source, require_config: bool,
                check_config: Callable[[dict[str, Any]], object] | None) -> CheckpointIndex:
    available = set(checked_listing(source.list_files(), source.description, keep=is_checkpoint_file))
    config: dict[str, Any] = {}
    if CONFIG_FILE in available:
        parsed = read_json(source, CONFIG_FILE)
        if not isinstance(parsed, dict):
            raise CheckpointIndexError(f"{CONFIG_FILE}: not a JSON object")
        config = parsed
    elif require_config:
        raise CheckpointIndexError(f"no {CONFIG_FILE} in {source.description}")
    if check_config is not None:
        check_config(config)
    files, weight_map = _safetensors_files(source, available)
    with ThreadPoolExecutor(min(HEADER_READ_THREADS, len(files))) as pool:
        headers = dict(zip(files, map_in_context(pool, lambda f: read_header(source, f), files), strict=True))
    hf_quant = read_json(source, HF_QUANT_CONFIG) if HF_QUANT_CONFIG in available else None
    view = dequantized_view(config, _merge(headers, weight_map), lambda infos: read_values(source, infos), hf_quant)
    tensors: dict[str, TensorInfo | DerivedTensor] = dict(view.tensors)  # a QuantizedTensor is derived
    return CheckpointIndex(source, config, tensors, headers, view.method, view.activation)


def read_values(source: Source, infos: list[TensorInfo]) -> list[np.ndarray]:
    """The values of small tensors (a few per request, several requests at once)."""
    def one(info: TensorInfo) -> np.ndarray:
        data = read_bytes(source, info.file, info.offset, info.nbytes)
        return np.frombuffer(data, info.dtype).reshape(info.shape)

    if not infos:
        return []
    with ThreadPoolExecutor(min(HEADER_READ_THREADS, len(infos))) as pool:
        return map_in_context(pool, one, infos)


__all__ = ["CheckpointIndex", "open_index", "read_json", "read_values"]
