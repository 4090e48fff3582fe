"""Parse and validate one safetensors file header, without trusting anything in it.

Layout of a safetensors file: an 8-byte little-endian unsigned header length ``N``, ``N`` bytes of
UTF-8 JSON (``{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}``),
then the data section; offsets are relative to the data section. This parser checks every field
the way the reference implementation does (a file is accepted here only if ``safetensors`` accepts
it; the few stricter rules are listed in ``tests/index/test_header.py``) and turns every defect into
a :class:`~otfload.errors.CorruptFileError` subclass naming the file and the tensor: it never raises
anything else, never reads past the file and never executes anything.
"""

from __future__ import annotations

import json
import struct
from typing import Any, NamedTuple

import numpy as np

from otfload.errors import CorruptFileError, HeaderError, TruncatedFileError, UnknownDtypeError
from otfload.index.dtypes import SAFETENSORS_DTYPES
from otfload.sources.base import Source

# The reference implementation refuses headers above 100 MB; a legitimate header of a 5 GB shard
# with thousands of tensors is well under 1 MB, so this cap only stops hostile files.
MAX_HEADER_BYTES = 100_000_000
# Bytes read speculatively with the length prefix, so most headers arrive in one request.
HEADER_PREFETCH_BYTES = 256 * 1024
_LENGTH = struct.Struct("<Q")
_U64_MAX = 2**64 - 1


class TensorInfo(NamedTuple):
    """Where one tensor's bytes are: ``file`` from absolute ``offset`` for ``nbytes`` bytes."""

    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    file: str
    offset: int
    nbytes: int


class FileHeader(NamedTuple):
    """A parsed header: tensors in file order, the ``__metadata__`` dict, and the data start."""

    file: str
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]
    data_start: int
    file_size: int


def header_length(prefix: bytes, file: str, file_size: int) -> int:
    """The JSON header length from the first 8 bytes, checked against the cap and file size."""
    if file_size == 0:
        raise CorruptFileError(file, "empty file (0 bytes): not a safetensors file")
    if file_size < _LENGTH.size or len(prefix) < _LENGTH.size:
        raise TruncatedFileError(file, f"file is {file_size} bytes, too short for a safetensors header")
    n: int
    (n,) = _LENGTH.unpack_from(prefix)
    if n > MAX_HEADER_BYTES:
        raise HeaderError(file, f"header length {n} exceeds the {MAX_HEADER_BYTES}-byte cap")
    if n + _LENGTH.size > file_size:
        raise TruncatedFileError(file, f"header length {n} runs past the end of the {file_size}-byte file")
    return n


def reject_duplicate_keys(pairs: list[tuple[str, object]]) -> dict[str, object]:
    """``json.loads`` object hook: a key given twice is ambiguous in a file from a stranger, so it is an error."""
    out: dict[str, object] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _decode_json(raw: bytes, file: str) -> dict[str, Any]:
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise HeaderError(file, f"header is not valid UTF-8 ({e.reason} at byte {e.start})") from None
    if not text.startswith("{"):
        raise HeaderError(file, "header does not start with '{'")
    try:
        parsed = json.loads(text, object_pairs_hook=reject_duplicate_keys)
    except (ValueError, RecursionError) as e:  # RecursionError: hostile deep nesting
        raise HeaderError(file, f"header is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise HeaderError(file, "header JSON is not an object")
    return parsed


def _is_u64(x: object) -> bool:
    # The reference parses sizes and offsets as u64: larger numbers are refused before any arithmetic.
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= _U64_MAX


def _is_utf8_text(x: object) -> bool:
    # JSON escapes can spell lone surrogates ("\ud800"), which no UTF-8 text (nor the reference) allows.
    if not isinstance(x, str):
        return False
    try:
        x.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _element_count(shape: list[int]) -> int | None:
    # Multiplied in order with the reference's u64 overflow check; also keeps every product small.
    count = 1
    for d in shape:
        count *= d
        if count > _U64_MAX:
            return None
    return count


def _tensor_entry(name: str, entry: object, file: str) -> tuple[np.dtype, tuple[int, ...], int, int]:
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise HeaderError(file, f"tensor {name!r}: entry must have exactly dtype, shape, data_offsets")
    dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype_name, str) or dtype_name not in SAFETENSORS_DTYPES:
        raise UnknownDtypeError(file, f"tensor {name!r}: unknown dtype {dtype_name!r}")
    if not isinstance(shape, list) or not all(_is_u64(d) for d in shape):
        raise HeaderError(file, f"tensor {name!r}: shape {shape!r} is not a list of 64-bit unsigned ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_u64(o) for o in offsets)):
        raise HeaderError(file, f"tensor {name!r}: data_offsets {offsets!r} is not two 64-bit unsigned ints")
    count = _element_count(shape)
    if count is None:
        raise HeaderError(file, f"tensor {name!r}: shape {shape} has more than 2**64 elements")
    dtype = SAFETENSORS_DTYPES[dtype_name]
    begin, end = offsets
    want = count * dtype.itemsize
    if end < begin or end - begin != want:
        raise HeaderError(
            file, f"tensor {name!r}: {dtype_name}{shape} needs {want} bytes but data_offsets span {end - begin}"
        )
    return dtype, tuple(shape), begin, end


def parse_header(raw_json: bytes, file: str, file_size: int) -> FileHeader:
    """Validate a header's JSON bytes (without the length prefix) for a file of ``file_size`` bytes."""
    data_start = _LENGTH.size + len(raw_json)
    parsed = _decode_json(raw_json, file)
    metadata = parsed.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(_is_utf8_text(k) and _is_utf8_text(v) for k, v in metadata.items()):
        raise HeaderError(file, "__metadata__ must map strings to strings")
    data_size = file_size - data_start
    if data_size < 0:
        raise TruncatedFileError(file, f"header needs {data_start} bytes but the file has only {file_size}")
    spans = []
    for name, entry in parsed.items():
        if not _is_utf8_text(name):
            raise HeaderError(file, f"tensor name {name!r} is not valid UTF-8 text")
        dtype, shape, begin, end = _tensor_entry(name, entry, file)
        if end > data_size:
            raise TruncatedFileError(
                file, f"tensor {name!r}: data_offsets [{begin}, {end}] run past the end of the {data_size}-byte data"
            )
        spans.append((begin, end, name, dtype, shape))
    spans.sort(key=lambda s: (s[0], s[1]))
    cursor = 0
    for begin, end, name, *_ in spans:
        if begin != cursor:
            what = "overlaps the previous tensor" if begin < cursor else f"leaves a gap after byte {cursor}"
            raise HeaderError(file, f"tensor {name!r}: data_offsets [{begin}, {end}] {what}")
        cursor = end
    if cursor < data_size:
        raise HeaderError(file, f"{data_size - cursor} trailing bytes after the last tensor")
    tensors = {
        name: TensorInfo(name, dtype, shape, file, data_start + begin, end - begin)
        for begin, end, name, dtype, shape in spans
    }
    return FileHeader(file, tensors, dict(metadata), data_start, file_size)


def read_header(source: Source, file: str) -> FileHeader:
    """Read and validate the header of ``file`` from a :class:`~otfload.sources.Source`."""
    file_size = source.size(file)
    want = min(file_size, HEADER_PREFETCH_BYTES)
    prefix = bytearray(want)
    source.read_into(file, 0, memoryview(prefix))
    n = header_length(bytes(prefix[: _LENGTH.size]), file, file_size)
    if _LENGTH.size + n <= want:
        raw = bytes(prefix[_LENGTH.size : _LENGTH.size + n])
    else:
        rest = bytearray(_LENGTH.size + n - want)
        source.read_into(file, want, memoryview(rest))
        raw = bytes(prefix[_LENGTH.size :]) + bytes(rest)
    return parse_header(raw, file, file_size)
