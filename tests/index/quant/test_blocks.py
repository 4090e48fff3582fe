"""Block-grid math against the expanded (np.repeat) reference, on boxes cutting through blocks."""

import numpy as np
import pytest

from otfload.index.quant.blocks import apply_blocks, block_box


def expanded(params: np.ndarray, block, shape) -> np.ndarray:
    for axis, b in enumerate(block):
        params = np.repeat(params, b, axis=axis)
    return params[tuple(slice(0, d) for d in shape)]


BOXES = [((0, 70), (0, 50)), ((5, 40), (17, 33)), ((48, 70), (0, 1)), ((0, 1), (49, 50)), ((16, 32), (24, 48)),
         ((3, 5), (20, 26))]


@pytest.mark.parametrize("box", BOXES)
@pytest.mark.parametrize("block", [(16, 24), (1, 50), (70, 50), (1, 8), (7, 1)])
@pytest.mark.parametrize("op", [np.multiply, np.subtract])
def test_apply_blocks_equals_expanded_reference(box, block, op):
    rng = np.random.default_rng(0)
    shape = (70, 50)
    values = rng.standard_normal(shape).astype(np.float32)
    grid = tuple(-(-d // b) for d, b in zip(shape, block, strict=True))
    params = rng.standard_normal(grid).astype(np.float32)
    sl = tuple(slice(a, b) for a, b in box)
    want = op(values, expanded(params, block, shape))[sl]
    gbox = block_box(box, block)
    got = apply_blocks(values[sl].copy(), params[tuple(slice(a, b) for a, b in gbox)], box, block, op)
    np.testing.assert_array_equal(got, want)


def test_apply_blocks_three_dims_with_leading_expert_axis():
    rng = np.random.default_rng(1)
    values = rng.standard_normal((3, 20, 40)).astype(np.float32)
    block = (1, 8, 16)
    params = rng.standard_normal((3, 3, 3)).astype(np.float32)
    box = ((1, 3), (5, 19), (7, 40))
    sl = tuple(slice(a, b) for a, b in box)
    want = (values * expanded(params, block, values.shape))[sl]
    gbox = block_box(box, block)
    got = apply_blocks(values[sl].copy(), params[tuple(slice(a, b) for a, b in gbox)], box, block)
    np.testing.assert_array_equal(got, want)


def test_block_box_covers_partial_blocks():
    assert block_box(((0, 128), (0, 256)), (128, 128)) == ((0, 1), (0, 2))
    assert block_box(((127, 129), (0, 1)), (128, 128)) == ((0, 2), (0, 1))
