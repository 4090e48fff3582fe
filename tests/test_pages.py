import errno
import mmap

import numpy as np
import pytest

from otfload.pages import MADV_POPULATE_READ, madvise, populate_pages, populate_write
from otfload.read.arena import aligned_empty
from otfload.sources.residency import resident_fraction, resident_pages

PAGE = mmap.PAGESIZE
FLAGS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS


def test_populate_write_makes_every_page_resident_before_any_write():
    region = mmap.mmap(-1, 64 * PAGE, flags=FLAGS)
    assert resident_fraction(region, 0, len(region)) == 0.0  # fresh: no page allocated yet
    populate_write(region)
    assert resident_fraction(region, 0, len(region)) == 1.0
    assert not np.frombuffer(region, np.uint8).any()  # zeroed, as a fault would give them


def test_populate_pages_makes_only_the_whole_pages_inside_the_array_resident():
    region = mmap.mmap(-1, 16 * PAGE, flags=FLAGS)
    data = np.frombuffer(region, np.uint8)
    populate_pages(data[3 * PAGE - 10 : 7 * PAGE + 10])  # pages 3-6 whole; 2 and 7 partial
    resident = resident_pages(region, 0, len(region))
    assert resident is not None
    assert resident.nonzero()[0].tolist() == [3, 4, 5, 6]


def test_an_unpopulated_aligned_buffer_gets_its_pages_part_by_part():
    rows = aligned_empty((8, 64 * PAGE // 8), np.uint8, populate=False)  # own mapping: 64 pages, none in yet
    region = _mapping(rows)
    assert resident_fraction(region, 0, len(region)) == 0.0
    populate_pages(rows[2:4])
    assert resident_fraction(region, 0, len(region)) == 2 / 8
    whole = _mapping(aligned_empty((64 * PAGE,), np.uint8))  # by default populated at once
    assert resident_fraction(whole, 0, len(whole)) == 1.0


def _mapping(array: np.ndarray) -> mmap.mmap:
    """The anonymous mapping an :func:`aligned_empty` buffer is a view of."""
    owner = array.base
    while not isinstance(owner, mmap.mmap):
        owner = owner.obj if isinstance(owner, memoryview) else owner.base
    return owner


def test_madvise_acts_on_exactly_the_range_asked():
    region = mmap.mmap(-1, 8 * PAGE, flags=FLAGS)
    data = np.frombuffer(region, np.uint8)
    data[:] = 7
    madvise(region, 2 * PAGE, 3 * PAGE, mmap.MADV_DONTNEED)  # private anonymous pages: dropped, read as zeros
    want = np.full(8 * PAGE, 7, np.uint8)
    want[2 * PAGE : 5 * PAGE] = 0
    np.testing.assert_array_equal(data, want)


def test_a_range_past_the_end_is_clipped_as_mmap_does():
    region = mmap.mmap(-1, 4 * PAGE, flags=FLAGS)
    data = np.frombuffer(region, np.uint8)
    data[:] = 1
    madvise(region, 3 * PAGE, 100 * PAGE, mmap.MADV_DONTNEED)
    assert data[: 3 * PAGE].all() and not data[3 * PAGE :].any()


def test_bad_calls_raise_what_mmap_madvise_raises(tmp_path):
    region = mmap.mmap(-1, 4 * PAGE, flags=FLAGS)
    with pytest.raises(ValueError):
        madvise(region, 4 * PAGE, PAGE, mmap.MADV_DONTNEED)  # starts past the end
    with pytest.raises(OSError) as unknown:
        madvise(region, 0, PAGE, 9999)
    assert unknown.value.errno == errno.EINVAL
    region.close()
    with pytest.raises(ValueError):
        madvise(region, 0, PAGE, mmap.MADV_DONTNEED)


def test_populating_pages_of_a_truncated_file_is_an_error_not_a_crash(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"x" * (4 * PAGE))
    with open(path, "rb") as f:
        region = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    path.write_bytes(b"x" * PAGE)  # truncated under the mapping: touching page 2 would be SIGBUS
    with pytest.raises(OSError) as beyond:
        madvise(region, 0, 4 * PAGE, MADV_POPULATE_READ)
    assert beyond.value.errno == errno.EFAULT
    region.close()
