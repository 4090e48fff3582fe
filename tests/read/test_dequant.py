import ml_dtypes
import numpy as np
import pytest

from otfload.plan.boxes import box_to_slices
from otfload.read.dequant import dequantize, scale_box


def quantize_blocks(w: np.ndarray, block) -> tuple[np.ndarray, np.ndarray]:
    """Reference FP8 block quantisation (what DeepSeek-V3 checkpoints hold)."""
    rows, cols = w.shape
    br, bc = block
    scales = np.zeros((-(-rows // br), -(-cols // bc)), np.float32)
    q = np.zeros(w.shape, ml_dtypes.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            blk = w[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            scales[i, j] = max(float(np.abs(blk).max()), 1e-12) / 448.0
            q[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = (blk / scales[i, j]).astype(ml_dtypes.float8_e4m3fn)
    return q, scales


def reference_dequant(q, scales, block):
    full = np.repeat(np.repeat(scales, block[0], 0), block[1], 1)[: q.shape[0], : q.shape[1]]
    return q.astype(np.float32) * full


@pytest.mark.parametrize("box", [((0, 70), (0, 50)), ((5, 40), (17, 33)), ((48, 70), (0, 1)), ((0, 1), (49, 50))])
def test_dequantize_a_box_equals_the_whole_tensor_reference(box):
    block = (16, 24)
    w = np.random.default_rng(0).standard_normal((70, 50)).astype(np.float32)
    q, scales = quantize_blocks(w, block)
    sbox = scale_box(box, block)
    got = dequantize(q[box_to_slices(box)], box, scales[box_to_slices(sbox)], block)
    want = reference_dequant(q, scales, block)[box_to_slices(box)]
    np.testing.assert_array_equal(got, want)
    assert np.abs(want - w[box_to_slices(box)]).max() <= np.abs(w).max() * 2**-3  # e4m3: 3 mantissa bits


def test_scale_box_covers_partial_blocks():
    assert scale_box(((0, 128), (0, 256)), (128, 128)) == ((0, 1), (0, 2))
    assert scale_box(((127, 129), (0, 1)), (128, 128)) == ((0, 2), (0, 1))
