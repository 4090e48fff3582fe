"""The safetensors header parser: exact results on real files and the same verdicts as the ``safetensors`` package.

Where otfload and the reference must differ, it is on purpose and listed in ``DIVERGENCES``: otfload is
stricter (it never accepts a file the reference rejects) and each stricter rule is explained there.
"""

from __future__ import annotations

import json
import struct

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from hypothesis import HealthCheck, given, settings

from otfload.errors import CorruptFileError, HeaderError, TruncatedFileError, UnknownDtypeError
from otfload.index.checkpoint import open_index
from otfload.index.dtypes import SAFETENSORS_DTYPES
from otfload.index.header import HEADER_PREFETCH_BYTES, MAX_HEADER_BYTES, header_length, read_header
from otfload.sources import LocalSource
from tests.index.strategies import mutated_files, valid_files, with_prefix
from tests.index.support import (
    FILE,
    MemorySource,
    RecordingSource,
    assert_same_as_reference,
    otfload_parse,
    reference_parse,
)

CROSS_CHECK = settings(
    max_examples=150, derandomize=True, database=None, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
# Dtypes the reference accepts that otfload refuses with UnknownDtypeError: no numpy/ml_dtypes type it
# could cast them to (sub-byte and complex types), so refusing early beats failing mid-load.
# dtype: (a shape, its byte size)
UNSUPPORTED_REFERENCE_DTYPES = {"C64": (1, 8), "F4": (2, 1), "F6_E2M3": (4, 3), "F6_E3M2": (4, 3)}
ML_DTYPES = {"BF16": ml_dtypes.bfloat16, "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
             "F8_E8M0": ml_dtypes.float8_e8m0fnu}


def _entry(dtype: str = "U8", shape: object = (2,), offsets: object = (0, 2), **extra) -> dict:
    shape, offsets = list(shape) if isinstance(shape, tuple) else shape, list(offsets)
    return {"dtype": dtype, "shape": shape, "data_offsets": offsets, **extra}


def _file(header: dict | str, data: bytes = b"xy") -> bytes:
    text = header if isinstance(header, str) else json.dumps(header)
    return with_prefix(text.encode(), data)


class _Pairs(list):
    """A JSON object kept as its list of pairs, so duplicate keys stay visible."""


def known_divergence(blob: bytes) -> str | None:
    """Why otfload may reject ``blob`` although the reference accepts it, or None if it must not."""
    try:
        text = blob[8 : 8 + struct.unpack_from("<Q", blob)[0]].decode()
        pairs = json.loads(text, object_pairs_hook=_Pairs)
    except (ValueError, struct.error, RecursionError):
        return None
    if not text.startswith("{"):
        return "the format requires the header to start with '{' (the reference now skips leading whitespace)"
    if not isinstance(pairs, _Pairs):
        return None
    names = [k for k, _ in pairs]
    if len(names) != len(set(names)):
        return "duplicate tensor names are ambiguous (the reference keeps the last silently)"
    for name, entry in pairs:
        if name != "__metadata__" and isinstance(entry, _Pairs):
            fields = dict(entry)
            if set(fields) - {"dtype", "shape", "data_offsets"}:
                return "an entry with unknown fields is not a file otfload understands (the reference ignores them)"
            if fields.get("dtype") in UNSUPPORTED_REFERENCE_DTYPES:
                return "dtype has no numpy equivalent to load it as"
    return None


DIVERGENCES = [
    pytest.param(_file({"a": _entry(), "b": _entry()}).replace(b'"b"', b'"a"'), HeaderError, id="duplicate-names"),
    pytest.param(_file({"a": _entry(extra=1)}), HeaderError, id="unknown-entry-field"),
    pytest.param(_file(" " + json.dumps({"a": _entry()})), HeaderError, id="leading-whitespace"),
    *(
        pytest.param(_file({"a": _entry(dt, (n,), (0, size))}, b"x" * size), UnknownDtypeError, id=f"dtype-{dt}")
        for dt, (n, size) in UNSUPPORTED_REFERENCE_DTYPES.items()
    ),
]


@pytest.mark.parametrize(("blob", "error"), DIVERGENCES)
def test_documented_divergences(blob: bytes, error: type):
    """The reference accepts these; otfload refuses each with a typed error, for a reason ``known_divergence`` gives."""
    assert not isinstance(reference_parse(blob), Exception)
    result, _ = otfload_parse(blob)
    assert type(result) is error
    assert known_divergence(blob) is not None


AGREED_REJECTIONS = [
    pytest.param(_file({"__metadata__": bad, "a": _entry()}), HeaderError, id=f"metadata-{bad!r}")
    for bad in ([], "", 0, False, {"k": 1})
] + [
    pytest.param(_file('{"\\ud800":' + json.dumps(_entry()) + "}"), HeaderError, id="lone-surrogate-name"),
    pytest.param(_file({"__metadata__": {"k": "\udfff"}}, b""), HeaderError, id="lone-surrogate-metadata"),
    pytest.param(_file({"a": _entry(shape=(2**32, 2**32, 0), offsets=(0, 0))}, b""), HeaderError, id="shape-overflow"),
    pytest.param(_file({"a": _entry(shape=(2**64,), offsets=(0, 0))}, b""), HeaderError, id="dim-above-u64"),
    pytest.param(_file({"a": _entry(shape=(10**4000, 10**4000), offsets=(0, 0))}, b""), HeaderError, id="huge-dims"),
    pytest.param(_file({"a": _entry(offsets=(0, 2**64 + 2))}), HeaderError, id="offset-above-u64"),
    pytest.param(_file({"a": _entry(shape=(2.0,))}), HeaderError, id="float-dim"),
    pytest.param(_file({"a": _entry(shape=(True, True))}), HeaderError, id="bool-dims"),
    pytest.param(_file({"a": _entry(offsets=(0, 2, 2))}), HeaderError, id="three-offsets"),
    pytest.param(_file({"a": _entry("u8")}), UnknownDtypeError, id="lowercase-dtype"),
    pytest.param(_file({"a": _entry(offsets=(1, 3))}, b"xyz"), HeaderError, id="gap"),
    pytest.param(_file({"a": _entry(), "b": _entry(offsets=(1, 3))}, b"xyz"), HeaderError, id="overlap"),
    pytest.param(_file({"a": _entry()}, b"xyz"), HeaderError, id="trailing-bytes"),
    pytest.param(_file({"a": _entry()}, b"x"), TruncatedFileError, id="data-past-end"),
    pytest.param(_file("\ufeff" + json.dumps({"a": _entry()})), HeaderError, id="byte-order-mark"),
    pytest.param(_file('{"a":' + "[" * 100_000 + "]" * 100_000 + "}", b""), HeaderError, id="deep-nesting"),
]


@pytest.mark.parametrize(("blob", "error"), AGREED_REJECTIONS)
def test_rejects_what_the_reference_rejects(blob: bytes, error: type):
    """Includes the cases otfload once accepted (falsy ``__metadata__``, lone surrogates, overflowing shapes)."""
    assert isinstance(reference_parse(blob), Exception)
    result, source = otfload_parse(blob)
    assert type(result) is error, result
    assert not source.out_of_bounds()


def test_huge_dimensions_fail_fast():
    """Thousands of 4000-digit dims once cost minutes of bignum products before any check; now one dim suffices."""
    dims = ",".join(["9" * 4000] * 2000)
    blob = _file('{"a":{"dtype":"U8","shape":[' + dims + '],"data_offsets":[0,0]}}', b"")
    result, _ = otfload_parse(blob)
    assert isinstance(result, HeaderError) and "shape" in str(result)


@pytest.mark.parametrize("dtype_name", sorted(SAFETENSORS_DTYPES))
def test_save_file_round_trip(closing, tmp_path, dtype_name: str):
    """Files written by ``safetensors.numpy.save_file`` parse to the reference's names, dtypes, shapes and bytes."""
    dtype = SAFETENSORS_DTYPES[dtype_name]
    rng = np.random.default_rng(0)
    shapes = {"scalar": (), "empty": (0, 3), "vector": (5,), "matrix": (3, 4), "cube": (2, 1, 3)}
    tensors = {
        k: rng.integers(0, 256, size=int(np.prod(s)) * dtype.itemsize, dtype=np.uint8).view(dtype).reshape(s)
        for k, s in shapes.items()
    }
    safetensors.numpy.save_file(tensors, tmp_path / FILE, metadata={"format": "np"})
    source = closing(RecordingSource(LocalSource(tmp_path)))
    header = read_header(source, FILE)
    assert header.metadata == {"format": "np"}
    assert not source.out_of_bounds() and source.reads[0][1] == 0
    assert_same_as_reference(header, reference_parse((tmp_path / FILE).read_bytes()), source)
    if dtype_name in ML_DTYPES:  # safetensors.numpy.load_file cannot build these; the bytes were compared above
        assert dtype == ML_DTYPES[dtype_name]
    else:
        loaded, raw = safetensors.numpy.load_file(tmp_path / FILE), (tmp_path / FILE).read_bytes()
        for name, info in header.tensors.items():
            got = np.frombuffer(raw, np.uint8, info.nbytes, info.offset).view(info.dtype).reshape(info.shape)
            np.testing.assert_array_equal(got, loaded[name])


@CROSS_CHECK
@given(valid_files())
def test_valid_files_match_reference(blob: bytes):
    header, source = otfload_parse(blob)
    assert_same_as_reference(header, reference_parse(blob), source)


@CROSS_CHECK
@given(mutated_files())
def test_accepts_iff_reference_accepts(blob: bytes):
    """Never accepts what the reference rejects; rejects what it accepts only for a documented divergence."""
    ours, source = otfload_parse(blob)
    theirs = reference_parse(blob)
    if isinstance(theirs, Exception):
        assert isinstance(ours, Exception), f"accepted a file the reference rejects: {theirs}"
    elif isinstance(ours, Exception):
        assert known_divergence(blob), f"rejected a file the reference accepts: {ours}"
    else:
        assert_same_as_reference(ours, theirs, source)


def test_empty_file_says_so(closing, tmp_path):
    """A 0-byte file is reported as empty, naming it (not as a header length or JSON problem)."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CorruptFileError, match=r"^model.safetensors: empty file \(0 bytes\)") as caught:
        read_header(closing(LocalSource(tmp_path)), "model.safetensors")
    assert caught.value.file == "model.safetensors"
    with pytest.raises(CorruptFileError, match="empty file"):
        open_index(closing(LocalSource(tmp_path)), require_config=False)


def test_header_length_limits():
    ok = struct.pack("<Q", 10)
    assert header_length(ok, "f", 18) == 10
    with pytest.raises(TruncatedFileError, match="too short"):
        header_length(ok[:7], "f", 7)
    with pytest.raises(TruncatedFileError, match="past the end"):
        header_length(ok, "f", 17)
    with pytest.raises(HeaderError, match=f"{MAX_HEADER_BYTES}-byte cap"):
        header_length(struct.pack("<Q", MAX_HEADER_BYTES + 1), "f", 2 * MAX_HEADER_BYTES)
    assert header_length(struct.pack("<Q", MAX_HEADER_BYTES), "f", MAX_HEADER_BYTES + 8) == MAX_HEADER_BYTES


@pytest.mark.parametrize("pad", [HEADER_PREFETCH_BYTES - 8 - 62, HEADER_PREFETCH_BYTES, 3 * HEADER_PREFETCH_BYTES])
def test_headers_beyond_the_prefetch_are_read_exactly(pad: int):
    """A header longer than the first read is fetched with one more read that stops at the data section."""
    text = json.dumps({"__metadata__": {"pad": "p" * pad}, "a": _entry()})
    source = RecordingSource(MemorySource({FILE: _file(text)}))
    header = read_header(source, FILE)
    assert header.data_start == 8 + len(text) and header.tensors["a"].offset == header.data_start
    assert not source.out_of_bounds()
    file_size = len(source.inner.files[FILE])
    assert max(o + n for _, o, n in source.reads) == min(file_size, max(header.data_start, HEADER_PREFETCH_BYTES))


def test_errors_name_the_file_and_tensor():
    result, _ = otfload_parse(_file({"w.q": _entry("F32", (3,), (0, 2))}))
    assert isinstance(result, HeaderError)
    assert result.file == FILE and "'w.q'" in str(result) and "12 bytes" in str(result)


def test_offsets_past_the_end_name_the_moved_tensor():
    """A tensor moved past the end is reported by name, not as a gap before the tensor that follows it."""
    blob = _file({"a": _entry(offsets=(2, 4)), "b": _entry(offsets=(10**9, 10**9 + 2))}, b"xyzw")
    result, _ = otfload_parse(blob)
    assert isinstance(result, TruncatedFileError) and "'b'" in str(result) and "past the end" in str(result), result
