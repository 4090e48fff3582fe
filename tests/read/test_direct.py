"""Cold files read with O_DIRECT: the same values as the mapped reads, the bytes that really moved
counted, and the page cache left as it was (checked with mincore)."""

import mmap
import os

import numpy as np
import pytest

from otfload.accounting.meter import FetchMeter, metering
from otfload.errors import TruncatedFileError
from otfload.index.checkpoint import open_index
from otfload.options import resolve_options
from otfload.plan.boxes import box_to_slices
from otfload.read.arena import Arena
from otfload.read.reader import DIRECT_IO_ENV, TensorReader
from otfload.sources import LocalSource
from otfload.sources.local import DIRECT_ALIGN
from otfload.sources.residency import resident_fraction
from tests.helpers import evict
from tests.synthetic import write_checkpoint


def drop_pages(directory):
    """The checkpoint files' pages out of the page cache (any user)."""
    for path in directory.glob("*.safetensors"):
        evict(path)


def resident(path) -> float:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as region:
        return resident_fraction(region, 0, len(region))


@pytest.fixture
def cold(tmp_path, closing):
    rng = np.random.default_rng(0)
    tensors = {
        "a": rng.standard_normal((7, 3001), dtype=np.float32),  # starts and ends off the block alignment
        "b": rng.standard_normal((64, 2048), dtype=np.float32),
    }
    directory = write_checkpoint(tmp_path / "c", tensors, files=1)
    source = closing(LocalSource(directory))
    drop_pages(directory)
    return source, tensors, directory


@pytest.mark.parametrize("key,box", [
    ("a", ((0, 7), (0, 3001))),  # the whole tensor
    ("a", ((2, 5), (0, 3001))),  # rows: one run
    ("b", ((0, 64), (512, 1024))),  # a column block: one run per row, read apart
    ("b", ((10, 11), (7, 9))),
])
def test_direct_reads_equal_numpy_and_leave_the_page_cache_alone(cold, key, box):
    source, tensors, directory = cold
    index = open_index(source, require_config=False)
    reader = TensorReader(source)
    assert reader.use_direct([index.tensors[key].file]) == {index.tensors[key].file}
    drop_pages(directory)  # the header reads above brought the first pages in
    meter = FetchMeter()
    with metering(meter):
        got = reader.read_box(index.tensors[key], box, Arena())
    np.testing.assert_array_equal(got, tensors[key][box_to_slices(box)])
    assert resident(next(directory.glob("*.safetensors"))) == 0.0  # nothing went through the page cache
    # what really moved: the box's page runs widened to the block alignment, never less than the box
    assert got.nbytes <= meter.bytes and meter.bytes % DIRECT_ALIGN == 0
    assert meter.bytes <= reader.stats.bytes_read + 2 * DIRECT_ALIGN * meter.requests


def test_read_direct_into_stops_at_the_end_of_the_file(cold):
    source, _, directory = cold
    (name,) = [p.name for p in directory.glob("*.safetensors")]
    size = (directory / name).stat().st_size
    start = (size - 1) // DIRECT_ALIGN * DIRECT_ALIGN
    out = np.frombuffer(mmap.mmap(-1, 2 * DIRECT_ALIGN), np.uint8)
    got = source.read_direct_into(name, start, out.data)
    assert got == size - start
    with open(directory / name, "rb") as f:
        f.seek(start)
        assert out[:got].tobytes() == f.read()


def test_a_file_truncated_after_planning_is_a_typed_error(cold):
    source, _, directory = cold
    index = open_index(source, require_config=False)
    info = index.tensors["b"]
    reader = TensorReader(source)
    reader.use_direct([info.file])
    os.truncate(directory / info.file, info.offset + 100)
    with pytest.raises(TruncatedFileError, match=info.file):
        reader.read_box(info, ((0, 64), (0, 2048)), Arena())


def test_a_cold_load_reads_direct_and_leaves_no_pages(tmp_path, closing, mesh_2x4, monkeypatch):
    """A whole load (stacked layers, sharded) from a file out of the page cache: read with O_DIRECT,
    the leaves equal numpy's, and the file's pages are still out of the page cache afterwards."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from otfload.place.loader import execute_plan
    from otfload.plan.abstract import abstract_from_pytree
    from otfload.plan.mapping import MappingTable, Rule
    from otfload.plan.planner import build_plan

    rng = np.random.default_rng(2)
    tensors = {f"l.{i}.w": rng.standard_normal((1024, 1024), dtype=np.float32) for i in range(4)}  # 16 MiB
    directory = write_checkpoint(tmp_path / "big", tensors, files=1)
    source = closing(LocalSource(directory))
    index = open_index(source, require_config=False)
    sharding = NamedSharding(mesh_2x4, P(None, "fsdp", "tp"))
    abstract = jax.ShapeDtypeStruct((4, 1024, 1024), np.float32, sharding=sharding)
    leaves, _ = abstract_from_pytree({"layers": {"w": abstract}})
    plan = build_plan(index, leaves, MappingTable((Rule("layers.{layer}.w", "l.{layer}.w"),)))
    drop_pages(directory)
    arrays, report = execute_plan(plan, source)
    want = np.stack([tensors[f"l.{i}.w"] for i in range(4)])
    for shard in arrays["layers.w"].addressable_shards:
        np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    (path,) = directory.glob("*.safetensors")
    assert resident(path) < 0.05  # read around the page cache, not through it
    assert report.bytes_read >= want.nbytes  # every byte came from the disk
    monkeypatch.setenv(DIRECT_IO_ENV, "0")  # the load's options read it (direct_io=False): execute_plan asks none
    assert resolve_options(None, {}).direct_io is False
