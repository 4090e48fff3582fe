"""Hypothesis strategies for safetensors files: valid ones written by the ``safetensors`` package, and hostile ones.

``valid_files`` are real files; ``mutated_files`` damage them at the byte level; ``hostile_headers`` build
headers field by field with out-of-range, overlapping, inconsistent or ill-typed values and then corrupt
the JSON text itself (deep nesting, non-UTF-8, non-string keys, huge numbers, bad length prefixes).
"""

from __future__ import annotations

import json
import math
import struct

import numpy as np
import safetensors.numpy
from hypothesis import strategies as st

from otfload.index.dtypes import SAFETENSORS_DTYPES
from otfload.index.header import MAX_HEADER_BYTES

DTYPE_NAMES = sorted(SAFETENSORS_DTYPES)
U64_MAX = 2**64 - 1
_PREFIX = struct.Struct("<Q")

tensor_names = st.text(st.characters(codec="utf-8"), max_size=6).filter(lambda s: s != "__metadata__")
# Integers a hostile header may hold where a size or offset is expected.
hostile_ints = st.one_of(
    st.integers(0, 16),
    st.integers(-(2**70), 2**70),
    st.sampled_from([-1, 2**31, 2**32, 2**63, U64_MAX, 2**64, 10**4000]),
)
json_scalars = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False), hostile_ints, st.text(max_size=4))
json_values = st.recursive(
    json_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner, max_size=3),
    max_leaves=4,
)
# Strategies are built once here: building them inside a draw costs more than drawing from them.
_ENTRY_MUTATIONS = st.sampled_from(
    ["dtype", "shape_dim", "shape_extend", "shape_value", "offsets", "offsets_shift", "drop", "extra", "entry"]
)
_BAD_DTYPES = st.sampled_from(["C64", "F6_E2M3", "F4", "bf16", "", "F32 "]) | json_values
_TEXT_CORRUPTIONS = st.sampled_from(
    ["none", "none", "deep", "non_utf8", "non_string_key", "cut", "garbage", "lead", "digits"]
)
_DEPTHS = st.integers(1, 5000) | st.sampled_from([990, 1000, 100_000])
_NON_UTF8 = st.sampled_from([b"\xff", b"\xc0\x80", b"\x80", b"\xed\xa0\x80", b"\xf4\x90\x80\x80", b"\xe2\x82"])
_LEADS = st.sampled_from([" ", "\ufeff", "\n", "[", "0"])
_DIGITS = st.sampled_from([20, 4299, 4301, 20_000])
_TENSOR_SPECS = st.lists(
    st.tuples(tensor_names, st.sampled_from(DTYPE_NAMES), st.lists(st.integers(0, 3), max_size=3)), max_size=4
)
_METADATA = json_values | st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2)
_DATA_DELTAS = st.sampled_from([0, 0, 0, -1, 1, 7])
_PREFIX_DELTAS = st.sampled_from([-1, 1, 8])
_HOSTILE_LENGTHS = st.sampled_from([MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, 2**63, U64_MAX]) | hostile_ints
_BYTE_MUTATIONS = st.sampled_from(["flip", "insert", "delete", "truncate", "append", "prefix"])
_DTYPE_NAMES = st.sampled_from(DTYPE_NAMES)
_SHAPES = st.lists(st.integers(0, 4), max_size=3)
_BYTES = st.integers(0, 255)
_SMALL = st.integers(1, 4)
_SHAPE_DIMS = hostile_ints | json_scalars
_EXTRA_DIMS = st.lists(hostile_ints, min_size=1, max_size=3)
_BAD_OFFSETS = st.lists(hostile_ints, max_size=3) | json_values
_SHIFTS = st.integers(-8, 8)


def with_prefix(raw_json: bytes, data: bytes = b"") -> bytes:
    """A file whose length prefix matches ``raw_json``."""
    return _PREFIX.pack(len(raw_json)) + raw_json + data


@st.composite
def arrays(draw) -> np.ndarray:
    dtype = SAFETENSORS_DTYPES[draw(_DTYPE_NAMES)]
    shape = tuple(draw(_SHAPES))
    raw = draw(st.binary(min_size=math.prod(shape) * dtype.itemsize, max_size=math.prod(shape) * dtype.itemsize))
    return np.frombuffer(raw, dtype).reshape(shape)


@st.composite
def valid_files(draw) -> bytes:
    """A file written by ``safetensors.numpy.save``: up to 4 tensors of any dtype, optional metadata."""
    tensors = draw(st.dictionaries(tensor_names, arrays(), max_size=4))
    metadata = draw(st.none() | st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2))
    if not tensors and metadata == {}:  # safetensors 0.8 writes the invalid header '{},"__metadata__":{}}' for this
        metadata = None
    return safetensors.numpy.save(tensors, metadata=metadata)


@st.composite
def mutated_files(draw) -> bytes:
    """A valid file with 1-3 byte-level mutations, mostly aimed at the prefix and header."""
    blob = bytearray(draw(valid_files()))
    for _ in range(draw(st.integers(1, 3))):
        header_end = min(len(blob), 8 + _PREFIX.unpack_from(blob)[0]) if len(blob) >= 8 else len(blob)
        pos = draw(st.integers(0, max(0, header_end - 1)) | st.integers(0, len(blob)))
        kind = draw(_BYTE_MUTATIONS)
        if kind == "flip" and pos < len(blob):
            blob[pos] = draw(_BYTES)
        elif kind == "insert":
            blob[pos:pos] = draw(st.binary(min_size=1, max_size=4))
        elif kind == "delete":
            del blob[pos : pos + draw(_SMALL)]
        elif kind == "truncate":
            del blob[pos:]
        elif kind == "append":
            blob += draw(st.binary(min_size=1, max_size=8))
        elif kind == "prefix" and len(blob) >= 8:
            n = _PREFIX.unpack_from(blob)[0]
            new = draw(st.sampled_from([0, 1, n - 1, n + 1, n + 8, MAX_HEADER_BYTES, MAX_HEADER_BYTES + 1, U64_MAX]))
            blob[:8] = _PREFIX.pack(max(0, min(new, U64_MAX)))
    return bytes(blob)


def _layout(specs: list[tuple[str, str, list[int]]]) -> tuple[list[tuple[str, object]], int]:
    """Header pairs for tensors stored back to back, and the data length they need."""
    pairs, cursor = [], 0
    for name, dtype, shape in specs:
        end = cursor + math.prod(shape) * SAFETENSORS_DTYPES[dtype].itemsize
        pairs.append((name, {"dtype": dtype, "shape": shape, "data_offsets": [cursor, end]}))
        cursor = end
    return pairs, cursor


@st.composite
def _mutate_entry(draw, entry: dict) -> object:
    entry = dict(entry)
    kind = draw(_ENTRY_MUTATIONS)
    if kind == "dtype":
        entry["dtype"] = draw(_BAD_DTYPES)
    elif kind == "shape_dim" and entry["shape"]:
        entry["shape"] = list(entry["shape"])
        entry["shape"][draw(st.integers(0, len(entry["shape"]) - 1))] = draw(_SHAPE_DIMS)
    elif kind == "shape_extend":
        entry["shape"] = list(entry["shape"]) + draw(_EXTRA_DIMS)
    elif kind == "shape_value":
        entry["shape"] = draw(json_values)
    elif kind == "offsets":
        entry["data_offsets"] = draw(_BAD_OFFSETS)
    elif kind == "offsets_shift":
        begin, end = entry["data_offsets"]
        entry["data_offsets"] = [begin + draw(_SHIFTS), end] if draw(st.booleans()) else [begin, end + draw(_SHIFTS)]
    elif kind == "drop":
        del entry[draw(st.sampled_from(sorted(entry)))]
    elif kind == "extra":
        entry[draw(st.text(max_size=4))] = draw(json_values)
    else:
        return draw(json_values)
    return entry


def _dump_pairs(pairs: list[tuple[str, object]]) -> str:
    """JSON object text from pairs, keeping duplicate keys."""
    return "{" + ",".join(f"{json.dumps(k)}:{json.dumps(v)}" for k, v in pairs) + "}"


@st.composite
def _corrupt_text(draw, text: str) -> bytes:
    kind = draw(_TEXT_CORRUPTIONS)
    if kind == "deep":
        depth = draw(_DEPTHS)
        return ('{"__metadata__":' + "[" * depth + "]" * depth + "," + text[1:]).encode()
    if kind == "non_utf8":
        pos = draw(st.integers(0, len(text)))
        bad = draw(_NON_UTF8)
        raw = text.encode()
        return raw[:pos] + bad + raw[pos:]
    if kind == "non_string_key" and '":' in text:
        return text.replace('"', "", 2).encode() if draw(st.booleans()) else text.replace('{"', "{1:", 1).encode()
    if kind == "cut":
        return text.encode()[: draw(st.integers(0, len(text)))]
    if kind == "garbage":
        return text.encode() + draw(st.binary(min_size=1, max_size=4))
    if kind == "lead":
        return draw(_LEADS).encode() + text.encode()
    if kind == "digits":
        return text.replace("0", "9" * draw(_DIGITS), 1).encode()
    return text.encode() + b" " * draw(st.integers(0, 8))


@st.composite
def hostile_headers(draw) -> bytes:
    """A file built field by field, then damaged at the entry, JSON-text, data-length and prefix level."""
    pairs, data_len = _layout(draw(_TENSOR_SPECS))
    pairs = [(k, draw(_mutate_entry(v)) if draw(st.integers(0, 2)) == 0 else v) for k, v in pairs]
    if pairs and draw(st.booleans()):
        pairs.insert(draw(st.integers(0, len(pairs))), draw(st.sampled_from(pairs)))  # duplicate key
    if draw(st.booleans()):
        pairs.insert(0, ("__metadata__", draw(_METADATA)))
    raw = draw(_corrupt_text(_dump_pairs(pairs)))
    data = b"\x00" * max(0, data_len + draw(_DATA_DELTAS))
    blob = with_prefix(raw, data)
    if draw(st.integers(0, 4)) == 0:
        new = len(raw) + draw(_PREFIX_DELTAS) if draw(st.booleans()) else draw(_HOSTILE_LENGTHS)
        blob = _PREFIX.pack(min(max(new, 0), U64_MAX)) + blob[8:]
    return blob


random_files = st.binary(max_size=64) | st.builds(
    lambda n, rest: _PREFIX.pack(n) + rest, st.integers(0, 80), st.binary(max_size=80)
)
any_hostile_file = st.one_of(random_files, mutated_files(), hostile_headers())
