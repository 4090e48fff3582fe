import itertools

import numpy as np
import pytest

from otfload.errors import MappingError
from otfload.plan.boxes import box_to_slices, crop, full_box
from otfload.plan.hooks import (
    Reshape,
    Scale,
    Slice,
    Transpose,
    chain_apply,
    chain_needed,
    chain_shapes,
    reshape_groups,
    run_forward,
)

CONFIG = {"heads": 4, "head_dim": 3, "hidden": 5, "half": 6, "scale": 0.5}

CHAINS = [
    ((12, 5), (Transpose(), Reshape(("hidden", "heads", "head_dim")))),  # q_proj
    ((5, 12), (Transpose(), Reshape(("heads", "head_dim", "hidden")))),  # o_proj
    ((12,), (Reshape(("heads", "head_dim")),)),  # bias
    ((12, 5), (Slice(0, 0, "half"), Transpose())),  # fused split, first half
    ((12, 5), (Slice(0, "half", None), Transpose())),  # fused split, second half
    ((5, 12), (Slice(1, 1, None, 2), Scale("scale"))),  # interleaved odd columns
    ((5, 2, 6), (Reshape((5, 12)), Transpose(), Reshape(("heads", "head_dim", "hidden")))),
    ((2, 3, 10), (Transpose((2, 0, 1)), Reshape((10, 6)))),
]


def sample_boxes(shape, limit=300):
    spans = [[(a, b) for a in range(n) for b in range(a + 1, n + 1)] for n in shape]
    boxes = list(itertools.product(*spans))
    rng = np.random.default_rng(0)
    picks = rng.choice(len(boxes), size=min(limit, len(boxes)), replace=False)
    return [boxes[i] for i in picks]


@pytest.mark.parametrize("in_shape,hooks", CHAINS)
def test_partial_reads_through_hooks_equal_numpy(in_shape, hooks):
    hooks = tuple(h.resolve(CONFIG) for h in hooks)
    x = np.random.default_rng(1).standard_normal(in_shape).astype(np.float32)
    shapes = chain_shapes(hooks, in_shape)
    expected = run_forward(hooks, x)
    assert expected.shape == shapes[-1]
    for box in sample_boxes(shapes[-1]):
        need = chain_needed(hooks, shapes, box)
        part = x[box_to_slices(need)]
        out, have = chain_apply(hooks, shapes, part, need)
        np.testing.assert_array_equal(crop(out, have, box), expected[box_to_slices(box)])


def test_partial_reads_are_partial():
    hooks = (Transpose(), Reshape((5, 4, 3)))
    shapes = chain_shapes(hooks, (12, 5))
    # one head of q_proj needs only that head's 3 rows of the HF tensor
    assert chain_needed(hooks, shapes, ((0, 5), (1, 2), (0, 3))) == ((3, 6), (0, 5))


@pytest.mark.parametrize("in_shape,hooks", CHAINS[:3] + CHAINS[6:])
def test_inverse_undoes_forward(in_shape, hooks):
    hooks = tuple(h.resolve(CONFIG) for h in hooks)
    x = np.random.default_rng(2).standard_normal(in_shape).astype(np.float32)
    shapes = chain_shapes(hooks, in_shape)
    y = run_forward(hooks, x)
    back = run_forward([h.inverse(s) for h, s in zip(reversed(hooks), reversed(shapes[:-1]), strict=True)], y)
    np.testing.assert_array_equal(back, x)


@pytest.mark.parametrize("in_shape,hooks", [*CHAINS[:3], ((2, 3, 10), (Transpose((2, 0, 1)), Scale(2.0)))])
def test_each_hook_answers_its_input_shape(in_shape, hooks):
    x = np.zeros(in_shape, np.float32)
    for hook in (h.resolve(CONFIG) for h in hooks):
        y = hook.forward(x)  # numpy gives the output shape
        assert hook.in_shape(y.shape) == x.shape
        x = y


def test_in_shape_refuses_what_the_output_does_not_determine():
    with pytest.raises(MappingError, match="does not determine"):
        Reshape((10, 6)).in_shape((10, 6))  # [60] or [10, 6] or [2, 5, 6] ...: no head names to merge
    with pytest.raises(MappingError, match="does not determine"):
        Reshape(("hidden", "heads", "hidden")).resolve(CONFIG).in_shape((5, 4, 5))
    with pytest.raises(MappingError, match="does not determine"):
        Slice(0, 0, "half").resolve(CONFIG).in_shape((6, 5))  # half of what?
    assert Slice(1).in_shape((6, 5)) == (6, 5)  # a slice keeping the whole axis
    # the resolved reshape remembers its field names, so the merged run is the head dims
    assert Reshape(("hidden", "heads", "head_dim")).resolve(CONFIG).in_shape((5, 4, 3)) == (5, 12)
    assert Reshape(("rank", "heads", -1)).resolve({"rank": 2, "heads": 4}).in_shape((2, 4, 3)) == (2, 12)


def test_reshape_groups():
    assert reshape_groups((12, 5), (3, 4, 5)) == [([0], [0, 1]), ([1], [2])]
    assert reshape_groups((1, 6), (6,)) == [([0, 1], [0])]
    assert reshape_groups((6, 1), (2, 3, 1, 1)) == [([0], [0, 1]), ([1], [2, 3])]
    with pytest.raises(MappingError):
        reshape_groups((5,), (6,))


def test_unresolved_config_name_is_a_mapping_error():
    with pytest.raises(MappingError, match="num_heads"):
        Reshape(("num_heads", -1)).resolve({})
    with pytest.raises(MappingError, match="cannot reshape"):
        Reshape((7, -1)).out_shape((12,))
    with pytest.raises(MappingError, match="no inverse"):
        Slice(0, 0, 2).inverse((4,))


def test_whole_tensor_hook_rejects_partial_box():
    class Negate(Transpose.__mro__[1]):  # the Hook base: whole-tensor only
        def out_shape(self, in_shape):
            return in_shape

        def forward(self, x):
            return -x

    hook = Negate()
    assert hook.needed(((0, 1),), (4,)) == full_box((4,))
    with pytest.raises(MappingError):
        hook.apply(np.zeros(1), ((0, 1),), (4,))
