import numpy as np
import pytest

from otfload.accounting.gaps import DEFAULT_GAPS, PLANNED_GAPS
from otfload.adapters.source import CombinedSource
from otfload.index.checkpoint import open_index
from otfload.plan.boxes import box_to_slices
from otfload.read.arena import ALIGNMENT, Arena, aligned_empty
from otfload.read.reader import TensorReader
from otfload.sources import LocalSource
from tests.index.support import RecordingSource
from tests.synthetic import write_checkpoint


@pytest.fixture
def index(tmp_path, closing):
    rng = np.random.default_rng(0)
    tensors = {
        "wide": rng.standard_normal((8, 5000), dtype=np.float32),  # rows of 20 KB
        "tall": rng.standard_normal((40, 20000), dtype=np.float32),  # rows of 80 KB: runs read apart
    }
    source = closing(LocalSource(write_checkpoint(tmp_path / "c", tensors, files=1), mmap=False))
    return open_index(source, require_config=False), tensors


@pytest.mark.parametrize("key,box,requests", [
    ("wide", ((0, 8), (0, 5000)), 1),
    ("wide", ((2, 5), (0, 5000)), 1),
    ("wide", ((0, 8), (1000, 2000)), 8),  # gaps are 4x the box: read each row's run
    ("tall", ((0, 40), (0, 19000)), 1),  # gaps of 4 KB (5 % extra): one span
    ("tall", ((0, 40), (5000, 10000)), 40),  # gaps of 60 KB: read each row's run
    ("tall", ((3, 4), (7, 9)), 1),
])
def test_read_box_equals_numpy_and_counts_requests(index, key, box, requests):
    idx, tensors = index
    reader = TensorReader(idx.source)
    got = reader.read_box(idx[key], box, Arena())
    np.testing.assert_array_equal(got, tensors[key][box_to_slices(box)])
    assert reader.stats.requests == requests


class UsersSource(RecordingSource):
    """A source written to the protocol before ``read_many`` took ``gaps``: it records each batch."""

    def __init__(self, inner):
        super().__init__(inner)
        self.batches = []

    def read_many(self, reads):
        self.batches.append((len(reads), None))
        self.inner.read_many(reads)


class GapReadingSource(UsersSource):
    """A source whose ``read_many`` takes the caller's gap rule, as every built-in one does."""

    def read_many(self, reads, gaps=DEFAULT_GAPS):
        self.batches.append((len(reads), gaps))
        self.inner.read_many(reads, gaps=gaps)


@pytest.mark.parametrize("kind,combined", [(UsersSource, False), (GapReadingSource, False),
                                           (UsersSource, True), (GapReadingSource, True)])
def test_the_reader_passes_its_gap_rule_to_sources_that_take_it(index, kind, combined):
    # A column block of 8 rows, read by ranges (the wrappers map nothing): one batch of 8 pieces. A
    # source that takes ``gaps`` is told the planned rule, directly or through a combined source; a
    # user's source without the keyword is called with the reads alone and reads them all the same.
    idx, tensors = index
    source = kind(idx.source)
    reader = TensorReader(CombinedSource(source, []) if combined else source)
    box = ((0, 8), (1000, 2000))
    np.testing.assert_array_equal(reader.read_box(idx["wide"], box, Arena()), tensors["wide"][box_to_slices(box)])
    assert source.batches == [(8, PLANNED_GAPS if kind is GapReadingSource else None)]


def test_arena_reuses_memory_and_aligns():
    arena = Arena()
    passes = []
    for _ in range(4):  # grows while it learns the shard size, then reuses the same memory
        arena.reset()
        passes.append(([arena.take(n).ctypes.data for n in (100, 1000, 10)], arena.capacity))
    (second, capacity2), (third, capacity3) = passes[2], passes[3]
    assert second == third and capacity2 == capacity3
    assert all(p % ALIGNMENT == 0 for p in third)
    assert third[1] - third[0] >= 100 and third[2] - third[1] >= 1000  # no overlap
    assert aligned_empty((3, 7), np.float32).ctypes.data % ALIGNMENT == 0


def test_mapped_source_gives_zero_copy_views_and_releases_pages(tmp_path, closing):
    big = np.random.default_rng(1).standard_normal((2048, 4096), dtype=np.float32)  # 32 MiB
    path = write_checkpoint(tmp_path / "m", {"big": big}, files=1)
    index = open_index(closing(LocalSource(path)), require_config=False)
    reader = TensorReader(index.source)
    box = ((0, 2048), (1024, 3072))
    view = reader.read_box(index["big"], box, Arena())
    assert not view.flags.owndata and not view.flags.writeable  # a view of the mapped file
    np.testing.assert_array_equal(view, big[:, 1024:3072])  # touches the pages
    mapped_before = rss_file()
    del view
    reader.release(index["big"], box)
    assert mapped_before - rss_file() >= 16 * 2**20  # the box's pages left our RSS


def rss_file() -> int:
    from pathlib import Path

    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssFile:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssFile in /proc/self/status")
