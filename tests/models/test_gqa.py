"""The GQA block's pieces against numpy: q/k norms per head and over the whole projection, and
partial rotary (the first dims rotated, the rest passed through)."""

import numpy as np
import pytest

from otfload.models.gqa import gqa_rope, qk_norm
from otfload.models.layers import apply_rope

RNG = np.random.default_rng(0)


def _rms(x: np.ndarray, scale: np.ndarray, axes: tuple[int, ...], eps: float) -> np.ndarray:
    x = x.astype(np.float64)
    return x / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps) * scale


@pytest.mark.parametrize("whole", [False, True], ids=["per_head", "whole"])
def test_qk_norm_normalises_each_head_or_the_whole_projection(whole):
    x = RNG.standard_normal((2, 5, 4, 8)).astype(np.float32) * 3
    scale = RNG.standard_normal((4, 8) if whole else (8,)).astype(np.float32)
    expected = _rms(x, scale, (-2, -1) if whole else (-1,), 1e-6)
    np.testing.assert_allclose(np.asarray(qk_norm(x, scale, 1e-6)), expected, rtol=2e-5, atol=2e-6)


def test_partial_rotary_rotates_the_first_dims_and_passes_the_rest():
    x = RNG.standard_normal((2, 6, 3, 16)).astype(np.float32)
    positions = np.tile(np.arange(6), (2, 1))
    cos, sin = gqa_rope(positions, 6, 1e4, None)
    assert cos.shape == (2, 6, 6)
    out = np.asarray(apply_rope(x, cos, sin))
    np.testing.assert_array_equal(out[..., 6:], x[..., 6:])
    # rotate-half on the first 6 dims: pairs (i, i + 3) turned by angle position / theta^(2i/6)
    angle = positions[..., None] / 1e4 ** (np.arange(0, 6, 2) / 6)
    c, s = np.cos(angle)[:, :, None], np.sin(angle)[:, :, None]
    a, b = x[..., :3], x[..., 3:6]
    np.testing.assert_allclose(out[..., :3], a * c - b * s, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out[..., 3:6], b * c + a * s, rtol=1e-5, atol=1e-6)
