"""Cache-state detection and the read strategy for local files (otfload.sources.residency), and the
read-ahead (otfload.read.readahead) on a cold page cache.

A file is made cold without root: ``posix_fadvise(DONTNEED)`` drops its clean pages from the page
cache; ``mincore`` on a fresh mapping is the independent check that it worked.
"""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import load_file

import otfload
from otfload.errors import InvalidOptionError, TruncatedFileError
from otfload.index.checkpoint import open_index
from otfload.read.arena import Arena
from otfload.read.readahead import ReadAhead, leaf_ranges
from otfload.read.reader import TensorReader
from otfload.sources import LocalSource
from otfload.sources.residency import (
    MIN_AHEAD_BYTES,
    WARM_FRACTION,
    Strategy,
    choose_strategy,
    file_resident_fraction,
    resident_fraction,
    resident_pages,
)
from tests.helpers import evict
from tests.synthetic import write_checkpoint

MIB = 1 << 20



def make_warm(path: Path) -> None:
    with open(path, "rb") as f:
        while f.read(8 * MIB):
            pass


def cold_or_skip(path: Path) -> None:
    evict(path)
    if (file_resident_fraction(path) or 0.0) > 0.5:  # e.g. a filesystem that ignores DONTNEED (tmpfs)
        pytest.skip(f"cannot drop {path}'s pages from the page cache here")


@pytest.fixture
def blob(tmp_path) -> tuple[Path, np.ndarray]:
    data = np.random.default_rng(0).integers(0, 256, 6 * MIB + 123, dtype=np.uint8)
    path = tmp_path / "blob.bin"
    data.tofile(path)
    return path, data


# --- the strategy: a pure function of residency and size -------------------------------------------


@pytest.mark.parametrize(
    "fraction,nbytes,expected",
    [
        (1.0, 64 * MIB, Strategy.MAP),  # warm: copy from the page cache, announce nothing
        (WARM_FRACTION, 64 * MIB, Strategy.MAP),
        (0.9, 64 * MIB, Strategy.READ_AHEAD),  # 6.4 MiB missing: worth the disk's head start
        (0.0, 64 * MIB, Strategy.READ_AHEAD),
        (0.0, MIN_AHEAD_BYTES - 1, Strategy.MAP),  # too small for a system call of its own
        (0.5, 2 * MIN_AHEAD_BYTES - 2, Strategy.MAP),  # less than MIN_AHEAD_BYTES missing
        (None, 64 * MIB, Strategy.READ_AHEAD),  # unknown residency: read as cold
        (None, 4096, Strategy.MAP),
        (0.0, 0, Strategy.MAP),
    ],
)
def test_choose_strategy(fraction, nbytes, expected):
    assert choose_strategy(fraction, nbytes) is expected


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_choose_strategy_refuses_a_fraction_outside_0_1(fraction):
    with pytest.raises(InvalidOptionError, match="resident_fraction"):
        choose_strategy(fraction, MIB)


# --- residency: mincore against what was just dropped or read ----------------------------------------


def test_residency_follows_the_page_cache(blob):
    path, _ = blob
    cold_or_skip(path)
    assert file_resident_fraction(path) < 0.1
    with open(path, "rb") as f:  # read the first 2 MiB only
        f.readinto(bytearray(2 * MIB))
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as region:
        pages = resident_pages(region, 0, len(region))
        assert pages is not None and len(pages) == -(-len(region) // mmap.PAGESIZE)
        assert pages[: 2 * MIB // mmap.PAGESIZE].all()  # what was read is resident
        assert resident_pages(region, len(region) - 10, 20) is None  # beyond the mapping: unknown
    make_warm(path)
    assert file_resident_fraction(path) == 1.0


def test_local_source_advise_reads_ahead_exactly_the_range(blob, closing):
    path, data = blob
    cold_or_skip(path)
    source = closing(LocalSource(path.parent))
    start, length = 2 * MIB, MIB
    assert source.resident_fraction(path.name, start, length) < 0.5
    source.advise(path.name, [(start, length)])
    deadline = time.monotonic() + 5
    while source.resident_fraction(path.name, start, length) < 1.0 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert source.resident_fraction(path.name, start, length) == 1.0  # the kernel read it, asynchronously
    assert source.resident_fraction(path.name, 5 * MIB, MIB) < 0.5  # and not far beyond it
    out = bytearray(length)
    source.read_into(path.name, start, memoryview(out))
    assert bytes(out) == data[start : start + length].tobytes()


def test_residency_of_a_truncated_range_is_unknown_and_reads_stay_typed(blob, closing):
    path, _ = blob
    source = closing(LocalSource(path.parent))
    size = path.stat().st_size
    assert source.resident_fraction(path.name, size - 100, 1000) is None
    with pytest.raises(TruncatedFileError):
        source.read_into(path.name, size - 100, memoryview(bytearray(1000)))


# --- the read-ahead on a real checkpoint ------------------------------------------------------------


@pytest.fixture
def stacked_checkpoint(tmp_path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(1)
    tensors = {f"layers.{i}.w": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(6)}  # 1 MiB each
    tensors["embed"] = rng.standard_normal((512, 1024), dtype=np.float32)
    return write_checkpoint(tmp_path / "ckpt", tensors, files=2), tensors


def _shards(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


@pytest.mark.parametrize("use_mmap", [True, False])
def test_read_ahead_announces_cold_ranges_then_reads_equal_bytes(stacked_checkpoint, use_mmap, closing):
    path, tensors = stacked_checkpoint
    for shard in _shards(path):
        cold_or_skip(shard)
    index = open_index(closing(LocalSource(path, mmap=use_mmap)), require_config=False)
    reader = TensorReader(index.source)
    names = sorted(tensors)
    leaves = [(name, index[name].nbytes) for name in names]
    box_of = {name: tuple((0, n) for n in tensors[name].shape) for name in names}

    def ranges_of(name):
        return reader.fetch_ranges(index[name], box_of[name])

    expected = sum(n for name in names for _, _, n in ranges_of(name))
    with ReadAhead(index.source, leaves, ranges_of, lead_bytes=64 * MIB) as ahead:
        for name in names:
            ahead.started(name)
            got = reader.read_box(index[name], box_of[name], Arena())
            np.testing.assert_array_equal(got, tensors[name])
        assert ahead.wait(timeout=10)
    assert ahead.announced + ahead.skipped == expected  # every range seen exactly once
    assert ahead.announced > 0  # cold: at least the ranges the builder had not reached yet

    with ReadAhead(index.source, leaves, ranges_of) as warm:  # now every page is resident
        for name in names:
            warm.started(name)
        assert warm.wait(timeout=10)
    assert warm.announced == 0 and warm.skipped == expected


def test_read_ahead_stays_within_its_lead(stacked_checkpoint, closing):
    path, tensors = stacked_checkpoint
    for shard in _shards(path):
        cold_or_skip(shard)
    index = open_index(closing(LocalSource(path)), require_config=False)
    reader = TensorReader(index.source)
    names = sorted(tensors)
    sizes = {name: index[name].nbytes for name in names}

    def ranges_of(name):
        return reader.fetch_ranges(index[name], tuple((0, n) for n in tensors[name].shape))

    ahead = ReadAhead(index.source, [(n, sizes[n]) for n in names], ranges_of, lead_bytes=sizes[names[0]])
    with ahead:
        deadline = time.monotonic() + 5
        while ahead.announced + ahead.skipped < sizes[names[0]] and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # room for a (wrong) run past the lead
        seen = ahead.announced + ahead.skipped
        # the first leaf and, within a lead of 1 leaf's bytes, the second: never the rest
        assert sizes[names[0]] <= seen <= sizes[names[0]] + sizes[names[1]] + 2 * mmap.PAGESIZE
    assert ahead.announced + ahead.skipped == seen  # closed: it stopped where it waited


def test_cold_load_equals_numpy_and_counts_each_byte_once(tiny_checkpoints, mesh_2x4):
    directory, _ = tiny_checkpoints("llama")
    files = _shards(directory)
    for shard in files:
        make_warm(shard)
    warm_model, warm_report = otfload.from_pretrained(directory, mesh=mesh_2x4, progress=False, return_report=True)
    for shard in files:
        cold_or_skip(shard)
    cold_model, cold_report = otfload.from_pretrained(directory, mesh=mesh_2x4, progress=False, return_report=True)
    warm_leaves, cold_leaves = _leaves(warm_model), _leaves(cold_model)
    assert len(warm_leaves) == len(cold_leaves)
    for warm, cold in zip(warm_leaves, cold_leaves, strict=True):
        np.testing.assert_array_equal(cold, warm)
    assert cold_report.bytes_read == warm_report.bytes_read  # read-ahead fetches nothing the builders do not
    reference = {}
    for shard in files:
        reference.update(load_file(str(shard)))
    embed = np.asarray(cold_model.embed.embedding[...])
    np.testing.assert_array_equal(embed, reference["model.embed_tokens.weight"])


def _leaves(model) -> list[np.ndarray]:
    import jax
    from flax import nnx

    return [np.asarray(x) for x in jax.tree.leaves(nnx.state(model))]


def test_leaf_ranges_are_what_the_builder_fetches(tiny_checkpoints, mesh_2x4, closing):
    from otfload.read.planned import planned_bytes

    directory, _ = tiny_checkpoints("llama")
    _, plan, planned_from = otfload.plan_model(directory, mesh=mesh_2x4)
    planned_from.close()
    reader = TensorReader(closing(LocalSource(directory)))
    total = sum(n for p in plan.leaves.values() for _, _, n in leaf_ranges(p, reader))
    assert total == planned_bytes(plan, reader)
    for p in plan.leaves.values():
        for file, offset, length in leaf_ranges(p, reader):  # each range inside one of the leaf's tensors
            assert any(s.file == file and s.offset <= offset and offset + length <= s.offset + s.nbytes
                       for s in p.sources)


def test_sampled_residency_estimates_a_half_warm_file(blob):
    path, _ = blob
    cold_or_skip(path)
    make_warm(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 3 * MIB, 0, os.POSIX_FADV_DONTNEED)  # the second half goes cold
    finally:
        os.close(fd)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as region:
        exact = resident_fraction(region, 0, len(region))
        sampled = resident_fraction(region, 0, len(region), max_pages=64)
        assert abs(sampled - exact) < 0.1 and 0.3 < exact < 0.8
        assert resident_fraction(region, 0, 4096 * 8, max_pages=64) == 1.0  # small: probed exactly


def test_read_ahead_starts_only_when_a_file_is_cold(tiny_checkpoints, mesh_2x4, closing):
    from otfload.read.readahead import cold_files, local_residency, start_read_ahead

    directory, _ = tiny_checkpoints("llama")
    _, plan, planned_from = otfload.plan_model(directory, mesh=mesh_2x4)
    planned_from.close()
    source = closing(LocalSource(directory))
    reader = TensorReader(source)
    files = _shards(directory)
    for shard in files:
        make_warm(shard)
    assert cold_files(source) == set()
    assert local_residency(reader) == (set(), 1.0)  # what a multi-process load agrees on (place/agree.py)
    assert start_read_ahead(plan, reader) is None  # warm: no thread, no range computed
    cold_or_skip(files[0])
    assert cold_files(source) == {files[0].name}
    sizes = {p.name: p.stat().st_size for p in files}
    cold, resident = local_residency(reader)  # type: ignore[misc]
    assert cold == {files[0].name} and resident is not None
    assert resident == pytest.approx(1 - sizes[files[0].name] / sum(sizes.values()), abs=0.02)  # by bytes
    ahead = start_read_ahead(plan, reader)
    assert ahead is not None
    try:
        for path in plan.leaves:
            ahead.started(path)
        assert ahead.wait(timeout=10)
        assert ahead.announced > 0
    finally:
        ahead.close()
