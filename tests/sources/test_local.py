"""LocalSource: listing, sizes, exact range reads, and typed errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from otfload.errors import SourceNotFoundError, TruncatedFileError
from otfload.sources import LocalSource
from otfload.sources.base import RangeRead, read_bytes

SHARD = "model-00002-of-00002.safetensors"


def test_lists_every_file_with_sizes(checkpoint: Path):
    src = LocalSource(checkpoint)
    assert src.list_files() == sorted(p.name for p in checkpoint.iterdir())
    assert all(src.size(f) == (checkpoint / f).stat().st_size for f in src.list_files())
    assert src.description == str(checkpoint.resolve()) and "LocalSource" in repr(src)


def test_range_reads_are_exact(checkpoint: Path):
    src = LocalSource(checkpoint)
    data = (checkpoint / SHARD).read_bytes()
    for offset, length in [(0, 8), (100, 5000), (len(data) - 1, 1), (0, len(data))]:
        assert read_bytes(src, SHARD, offset, length) == data[offset : offset + length]
    reads = [RangeRead(SHARD, off, memoryview(bytearray(64))) for off in range(0, 10_000, 1000)]
    src.read_many(reads)
    assert all(bytes(r.out) == data[r.offset : r.offset + 64] for r in reads)
    src.close()


def test_errors(checkpoint: Path, tmp_path: Path):
    with pytest.raises(SourceNotFoundError):
        LocalSource(tmp_path / "missing")
    src = LocalSource(checkpoint)
    with pytest.raises(SourceNotFoundError):
        src.size("nope.safetensors")
    with pytest.raises(SourceNotFoundError, match="outside"):
        src.size("../escape.json")
    with pytest.raises(TruncatedFileError):
        src.read_into(SHARD, src.size(SHARD) - 2, memoryview(bytearray(4)))
