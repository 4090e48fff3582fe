"""Property-based fuzzing of ``read_header``: random, mutated and hand-built hostile files.

Every case must end in a typed ``CorruptFileError`` naming the file, or in a parse the ``safetensors`` package
agrees with byte for byte; any other exception fails, so does a slow case (the deadline guards against
hangs), and every range read is checked to lie inside the file. The profile is derandomized, so CI runs
the same cases every time: 2,550 cases in about 7 s of CPU, each outcome class reached. ``OTFLOAD_FUZZ_SCALE``
multiplies the number of cases (``4``: the 10,200 of docs/reliability.md; see ``scripts/fuzz_report.py``, which
runs these tests and prints the outcome counts).
"""

from __future__ import annotations

import os
from collections import Counter
from datetime import timedelta

from hypothesis import HealthCheck, given, settings

from otfload.errors import CorruptFileError
from otfload.index.header import FileHeader
from tests.index.strategies import hostile_headers, mutated_files, random_files
from tests.index.support import FILE, assert_same_as_reference, otfload_parse, reference_parse

SCALE = float(os.environ.get("OTFLOAD_FUZZ_SCALE", "1"))
settings.register_profile(
    "otfload-fuzz",
    derandomize=True,
    database=None,
    deadline=timedelta(seconds=2),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    print_blob=True,
)
FUZZ = settings.get_profile("otfload-fuzz")

# Outcome of every case run in this process: the error class name, or "parsed".
OUTCOMES: Counter[str] = Counter()


def _assert_covers_file(header: FileHeader) -> None:
    cursor = header.data_start
    for info in sorted(header.tensors.values(), key=lambda t: (t.offset, t.nbytes)):
        assert info.offset == cursor and info.nbytes == info.dtype.itemsize * _count(info.shape)
        cursor += info.nbytes
    assert cursor == header.file_size


def _count(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def check_case(blob: bytes) -> str:
    """Run one file through the parser and check the outcome; returns and counts the outcome's name."""
    result, source = otfload_parse(blob)
    assert not source.out_of_bounds(), source.reads
    if isinstance(result, Exception):
        assert isinstance(result, CorruptFileError) and result.file == FILE, repr(result)
        outcome = type(result).__name__
    else:
        _assert_covers_file(result)
        reference = reference_parse(blob)
        assert not isinstance(reference, Exception), f"accepted a file the reference rejects: {reference}"
        assert_same_as_reference(result, reference, source)
        outcome = "parsed"
    OUTCOMES[outcome] += 1
    return outcome


@settings(FUZZ, max_examples=int(1000 * SCALE))
@given(random_files)
def test_random_bytes(blob: bytes):
    check_case(blob)


@settings(FUZZ, max_examples=int(750 * SCALE))
@given(mutated_files())
def test_mutated_valid_files(blob: bytes):
    check_case(blob)


@settings(FUZZ, max_examples=int(800 * SCALE))
@given(hostile_headers())
def test_hostile_headers(blob: bytes):
    check_case(blob)
