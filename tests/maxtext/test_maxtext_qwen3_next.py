"""Qwen3-Next scanned against the real MaxText (maxtext 0.2.5, its venv), where MaxText's own loader
is not the reference: ``test_maxtext_drop_in.py`` has the unscanned tree bitwise equal to MaxText's
loader's. Scanned, MaxText stacks the linear-attention layers twice (``local_layers`` ``[blocks, 3]``
at ``param_scan_axis`` and the next dimension), and its dynamic loader fails on that at either
``param_scan_axis`` (an ``IndexError`` in ``tensor_handling.sharding_at``); its offline converter's
steps (``reference.maxtext_convert``) build the tree at ``param_scan_axis`` 1 (at 0 they fail too: a
``ValueError``, a repeated axis in ``np.moveaxis``). So: at 1 every leaf bitwise the converter's and
MaxText's forward on the drop-in's tree within 1e-4 of transformers' logits; at 0 every leaf with the
tree's shape, dtype and sharding (the values: ``tests/maxtext_tables/test_qwen3_next.py``'s numpy)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed (its own venv: scripts/make_maxtext_venv.sh)")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from tests.helpers import max_rel_diff  # noqa: E402
from tests.maxtext import reference  # noqa: E402
from tests.maxtext.models import FAMILIES  # noqa: E402
from tests.maxtext.test_maxtext_drop_in import bits, built, otfload_loaded  # noqa: E402

FAMILY = FAMILIES["qwen3_next"]


@pytest.mark.parametrize("axis", [1, 0])
def test_maxtext_loader_cannot_load_it_scanned(refs, axis):
    with pytest.raises(IndexError):
        reference.maxtext_load(built(FAMILY, (True, axis)), refs / FAMILY.checkpoint)


@pytest.mark.parametrize("axis", [1, 0])
def test_drop_in_fills_the_scanned_tree(refs, axis):
    """Every leaf with the tree's shape, dtype and sharding; at ``param_scan_axis`` 1 bitwise what
    MaxText's offline converter gives."""
    layout = (True, axis)
    want = reference.flat(built(FAMILY, layout).params)
    ours = reference.flat(otfload_loaded(FAMILY, layout, refs)["params"])
    assert set(ours) == set(want)
    for name, target in want.items():
        assert (ours[name].shape, ours[name].dtype) == (target.shape, target.dtype), name
        assert ours[name].sharding.is_equivalent_to(target.sharding, target.ndim), name
    if axis == 1:
        converted = reference.flat(reference.maxtext_convert(built(FAMILY, layout), refs / FAMILY.checkpoint)["params"])
        for name, leaf in ours.items():
            np.testing.assert_array_equal(bits(leaf), bits(converted[name]), err_msg=name)


def test_maxtext_forward_on_the_scanned_drop_in_matches_transformers(refs):
    layout = (True, 1)
    ids = np.load(refs / FAMILY.checkpoint / "ids.npy")
    expected = np.load(refs / FAMILY.checkpoint / "logits.npy")
    got = reference.logits(built(FAMILY, layout), otfload_loaded(FAMILY, layout, refs), ids)
    assert max_rel_diff(got, expected) <= 1e-4, max_rel_diff(got, expected)
