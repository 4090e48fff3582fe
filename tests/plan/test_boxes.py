import itertools

import numpy as np
import pytest

from otfload.plan.boxes import (
    box_from_index,
    box_to_slices,
    byte_runs,
    cover_range,
    crop,
    flat_range,
    full_box,
)

SHAPES = [(7,), (4, 6), (3, 4, 5), (2, 3, 4, 5)]


def all_boxes(shape, limit=400):
    spans = [[(a, b) for a in range(n) for b in range(a + 1, n + 1)] for n in shape]
    return list(itertools.islice(itertools.product(*spans), limit))


@pytest.mark.parametrize("shape", SHAPES)
def test_byte_runs_hold_exactly_the_box(shape):
    data = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
    raw = data.tobytes()
    for box in all_boxes(shape):
        runs = byte_runs(shape, 4, box)
        got = b"".join(raw[r.offset : r.offset + r.length] for r in runs)
        assert got == np.ascontiguousarray(data[box_to_slices(box)]).tobytes(), box
        # merged: no two runs touch
        assert all(a.offset + a.length < b.offset for a, b in zip(runs, runs[1:], strict=False))


def test_full_box_is_one_run():
    assert byte_runs((3, 4), 2, full_box((3, 4))) == [(0, 24)]
    assert byte_runs((3, 4), 2, ((1, 3), (0, 4))) == [(8, 16)]
    assert byte_runs((3, 4), 2, ((0, 3), (1, 2))) == [(2, 2), (10, 2), (18, 2)]
    assert byte_runs((3, 4), 2, ((0, 0), (0, 4))) == []


@pytest.mark.parametrize("shape", SHAPES)
def test_cover_range_is_smallest_covering_box(shape):
    total = int(np.prod(shape))
    flat = np.arange(total).reshape(shape)
    for lo in range(0, total, 3):
        for hi in range(lo + 1, total + 1, 5):
            box = cover_range(lo, hi, shape)
            held = set(flat[box_to_slices(box)].ravel())
            assert set(range(lo, hi)) <= held
            blo, bhi = flat_range(box, shape)
            assert held == set(range(blo, bhi))  # a box with no holes: exactly its flat range
            assert blo <= lo and bhi >= hi


def test_box_from_index_and_crop():
    assert box_from_index((slice(None), slice(2, 4)), (3, 8)) == ((0, 3), (2, 4))
    with pytest.raises(ValueError):
        box_from_index((slice(0, 4, 2),), (8,))
    x = np.arange(24).reshape(4, 6)
    have = ((1, 4), (0, 6))
    part = x[1:4]
    np.testing.assert_array_equal(crop(part, have, ((2, 3), (1, 5))), x[2:3, 1:5])
