"""``Shift`` (a constant added, MaxText's Gemma norm ``x + 1.0``) and the ``bfloat16`` expression
function (a constant rounded as MaxText's Gemma 3 embedding scale is), as pure functions."""

import math

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from otfload.errors import MappingError
from otfload.plan.boxes import box_to_slices
from otfload.plan.expressions import evaluate
from otfload.plan.hooks import Scale, Shift, Transpose, chain_apply, chain_needed, chain_shapes, run_forward

CONFIG = {"hidden": 48, "one": 1}


def test_shift_adds_in_float32_and_rounds_once():
    x = np.random.default_rng(0).standard_normal((4, 6)).astype(np.float32)
    np.testing.assert_array_equal(Shift(1.0).forward(x), x + np.float32(1.0))
    b = x.astype(ml_dtypes.bfloat16)
    y = Shift("one").resolve(CONFIG).forward(b)
    assert y.dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(y, (b.astype(np.float32) + 1.0).astype(ml_dtypes.bfloat16))


def test_shift_inverse_subtracts_to_the_rounding_of_the_sum():
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 0.1
    hook = Shift(1.0)
    back = hook.inverse(x.shape).forward(hook.forward(x))
    assert np.max(np.abs(back - x)) <= np.finfo(np.float32).eps  # (x + 1) rounds at 2^-23
    assert not np.array_equal(back, x)  # and does round: an export through it is not bit-exact
    assert Shift("one").inverse(x.shape).resolve(CONFIG) == Shift(-1.0)


def test_shift_carries_any_box_and_runs_on_jax_arrays():
    x = np.arange(24, dtype=np.float32).reshape(4, 6)
    hooks = (Transpose(), Shift(1.0))
    shapes = chain_shapes(hooks, x.shape)
    box = ((1, 4), (0, 3))
    need = chain_needed(hooks, shapes, box)
    out, have = chain_apply(hooks, shapes, x[box_to_slices(need)], need)
    assert have == box
    np.testing.assert_array_equal(out, run_forward(hooks, x)[box_to_slices(box)])
    np.testing.assert_array_equal(np.asarray(Shift(1.0).forward(jnp.asarray(x))), x + 1)


def test_unresolved_shift_is_refused():
    with pytest.raises(MappingError, match="not resolved"):
        Shift("one").forward(np.zeros(3, np.float32))


def test_bfloat16_rounds_a_constant_as_ml_dtypes_does():
    value = evaluate("bfloat16(sqrt(hidden))", CONFIG)
    assert value == float(ml_dtypes.bfloat16(math.sqrt(48))) == 6.9375 != math.sqrt(48)
    assert evaluate("bfloat16(8)", CONFIG) == 8.0
    x = np.ones(3, np.float32)
    np.testing.assert_array_equal(Scale("bfloat16(sqrt(hidden))").resolve(CONFIG).forward(x), 6.9375)
