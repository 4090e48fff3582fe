import math

import numpy as np
import pytest

from otfload.errors import MappingError
from otfload.plan.expressions import evaluate, fields, integer
from otfload.plan.hooks import Reshape, Scale, Slice

CONFIG = {"head_dim": 128, "heads": 4, "hidden": 64, "eps": 1e-6, "flag": True, "name": "x"}


@pytest.mark.parametrize(
    "expression,expected",
    [
        ("head_dim", 128),
        ("1 / sqrt(head_dim)", 1 / math.sqrt(128)),
        ("rsqrt(head_dim)", 1 / math.sqrt(128)),
        ("heads * head_dim", 512),
        ("hidden // heads - 1", 15),
        ("-heads + 2 ** 3", 4),
        ("max(heads, 7) % 5", 2),
        ("ceil(hidden / 3)", 22),
    ],
)
def test_expressions_evaluate_as_python_would(expression, expected):
    assert evaluate(expression, CONFIG) == expected


def test_a_plain_field_keeps_its_type():
    assert isinstance(evaluate("heads", CONFIG), int)
    assert fields("1 / sqrt(head_dim) * heads") == {"head_dim", "heads"}


@pytest.mark.parametrize(
    "expression,message",
    [
        ("missing_field * 2", "'missing_field'"),
        ("__import__('os')", "not allowed"),
        ("heads.real", "not allowed"),
        ("[heads]", "not allowed"),
        ("flag + 1", "not a number"),
        ("name * 2", "not a number"),
        ("heads / 0", "division"),
        ("sqrt(-heads)", "sqrt"),
        ("heads +", "not arithmetic"),
        ("1" * 300, "characters"),
    ],
)
def test_anything_else_is_a_mapping_error_naming_it(expression, message):
    with pytest.raises(MappingError, match=message):
        evaluate(expression, CONFIG)


def test_integer_refuses_a_fraction():
    assert integer("hidden / heads", CONFIG, "size") == 16
    with pytest.raises(MappingError, match="not an integer"):
        integer("hidden / 3", CONFIG, "size")


def test_hooks_resolve_expressions():
    assert Scale("1 / sqrt(head_dim)").resolve(CONFIG) == Scale(1 / math.sqrt(128))
    assert Reshape(("heads", "hidden // heads")).resolve(CONFIG).shape == (4, 16)
    assert Slice(0, "hidden // 2", None).resolve(CONFIG) == Slice(0, 32, None)


def test_scale_rounds_in_the_tensor_dtype_and_its_inverse_divides():
    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32)
    hook = Scale("1 / sqrt(head_dim)").resolve(CONFIG)
    y = hook.forward(x)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, x * np.float32(1 / math.sqrt(128)))
    back = hook.inverse(x.shape).forward(y)
    np.testing.assert_array_equal(back, y / np.float32(1 / math.sqrt(128)))
    assert np.max(np.abs(back - x)) <= 2 * np.finfo(np.float32).eps * np.max(np.abs(x))
    power_of_two = Scale("1 / sqrt(64)").resolve(CONFIG)  # exact both ways
    np.testing.assert_array_equal(power_of_two.inverse(x.shape).forward(power_of_two.forward(x)), x)
