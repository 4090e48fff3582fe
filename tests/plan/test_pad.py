import itertools

import numpy as np
import pytest

from otfload.errors import MappingError
from otfload.plan.boxes import box_to_slices, crop
from otfload.plan.hooks import Pad, Slice, Transpose, chain_apply, chain_needed, chain_shapes, run_forward

CONFIG = {"vocab": 10, "padded": 16}


def test_pad_grows_the_axis_with_its_value():
    x = np.arange(20, dtype=np.float32).reshape(10, 2)
    hook = Pad(0, "padded", value=-1.0).resolve(CONFIG)
    y = hook.forward(x)
    assert y.shape == (16, 2)
    np.testing.assert_array_equal(y[:10], x)
    np.testing.assert_array_equal(y[10:], -1.0)


@pytest.mark.parametrize("hooks", [(Pad(0, "padded"),), (Transpose(), Pad(1, "padded"))])
def test_every_box_of_a_padded_leaf_reads_only_stored_rows(hooks):
    """Boxes in the stored part, across its end and wholly in the padding (a device holding only
    padding rows) all equal numpy's padded array, and no box reads past the stored rows."""
    hooks = tuple(h.resolve(CONFIG) for h in hooks)
    in_shape = (10, 3) if len(hooks) == 1 else (3, 10)
    x = np.random.default_rng(0).standard_normal(in_shape).astype(np.float32)
    shapes = chain_shapes(hooks, in_shape)
    expected = run_forward(hooks, x)
    padded_axis = 0 if len(hooks) == 1 else 1
    for lo, hi in itertools.combinations(range(17), 2):
        box = [(0, n) for n in shapes[-1]]
        box[padded_axis] = (lo, hi)
        box = tuple(box)
        need = chain_needed(hooks, shapes, box)
        assert all(0 <= a < b <= n for (a, b), n in zip(need, in_shape, strict=True))
        out, have = chain_apply(hooks, shapes, x[box_to_slices(need)], need)
        np.testing.assert_array_equal(crop(out, have, box), expected[box_to_slices(box)])


def test_pad_inverse_slices_the_padding_off():
    hook = Pad(0, "padded", original="vocab").resolve(CONFIG)
    assert hook.inverse((10, 2)) == Slice(0, 0, 10)
    assert hook.in_shape((16, 2)) == (10, 2)
    with pytest.raises(MappingError, match="does not determine"):
        Pad(0, 16).in_shape((16, 2))


def test_pad_never_cuts_a_longer_axis():
    with pytest.raises(MappingError, match="more than the 8"):
        Pad(0, 8).out_shape((10, 2))
    with pytest.raises(MappingError, match="not 12"):
        Pad(0, 16, original=12).out_shape((10, 2))


def test_pad_and_scale_run_on_device_arrays_as_on_numpy():
    """Where hooks run on the device (place/device_hooks.py traces them under jit) Pad and Scale
    give numpy's values: the bfloat16 scale rounded once from float32."""
    import jax
    import jax.numpy as jnp
    import ml_dtypes

    from otfload.plan.hooks import Scale

    hooks = (Pad(0, "padded").resolve(CONFIG), Scale(0.3))
    x = np.random.default_rng(0).standard_normal((10, 3)).astype(ml_dtypes.bfloat16)
    shapes = chain_shapes(hooks, x.shape)
    want = run_forward(hooks, x)
    np.testing.assert_array_equal(want, (x.astype(np.float32) * np.float32(0.3)).astype(ml_dtypes.bfloat16)
                                  [np.r_[0:10, [0] * 6]] * np.r_[[1] * 10, [0] * 6][:, None])
    box = ((0, 10), (0, 3))
    got = jax.jit(lambda a: chain_apply(hooks, shapes, a, box)[0])(jnp.asarray(x))
    np.testing.assert_array_equal(np.asarray(got), want)
