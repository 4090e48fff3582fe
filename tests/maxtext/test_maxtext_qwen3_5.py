"""Qwen3.5 (``qwen3.5-35b-a3b``: MoE, Gated DeltaNet) against the real MaxText (maxtext 0.2.5, its venv),
in every layout MaxText has (scanned at ``param_scan_axis`` 1 and 0, unscanned), one tiny checkpoint: the
multimodal one as published (text model under ``model.language_model.``, a vision tower never read, each
layer's experts fused in ``mlp.experts.gate_up_proj`` / ``down_proj``, as the bfloat16 releases hold them).

MaxText 0.2.5's dynamic loader loads it in no layout: scanned at ``param_scan_axis`` 1 an ``IndexError``
(``tensor_handling._build_single_axis_stacked_tensor`` deletes the layer axis from the sharding spec of a
leaf sharded ``PartitionSpec()``), at 0 and unscanned a ``KeyError``: its tensor getter looks up the
converter's composite HF key ``(in_proj_qkv, in_proj_z)`` as one tensor name. Its offline converter's
steps (``reference.maxtext_convert``: the same mapping and hooks, its ``concat_qkvz_and_transpose`` /
``concat_ba_and_transpose`` joins, its stacking) load every layout, so they are the reference: every leaf
of the drop-in bitwise theirs, with the tree's shape, dtype and sharding. Then MaxText's forward on the
drop-in's scanned tree gives transformers' float32 logits within 1e-4 x max|logits|."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed (its own venv: scripts/make_maxtext_venv.sh)")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from tests.helpers import max_rel_diff  # noqa: E402
from tests.maxtext import reference  # noqa: E402
from tests.maxtext.models import FAMILIES, LAYOUTS  # noqa: E402
from tests.maxtext.test_maxtext_drop_in import bits, built, otfload_loaded  # noqa: E402

FAMILY = FAMILIES["qwen3_5"]
QKVZ = ("model.language_model.layers.0.linear_attn.in_proj_qkv.weight",
        "model.language_model.layers.0.linear_attn.in_proj_z.weight")
IDS = {layout: f"scan-axis{layout[1]}" if layout[0] else "unscanned" for layout in LAYOUTS}


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS.get)
def test_maxtext_loader_cannot_load_it(refs, layout):
    if layout == (True, 1):
        with pytest.raises(IndexError, match="list assignment index out of range"):
            reference.maxtext_load(built(FAMILY, layout), refs / FAMILY.checkpoint)
    else:
        with pytest.raises(KeyError) as failed:
            reference.maxtext_load(built(FAMILY, layout), refs / FAMILY.checkpoint)
        assert failed.value.args[0] == QKVZ


@pytest.mark.parametrize("layout", LAYOUTS, ids=IDS.get)
def test_drop_in_equals_maxtext_converter(refs, layout):
    """Every leaf with the tree's shape, dtype and sharding, bitwise what MaxText's converter gives."""
    want = reference.flat(built(FAMILY, layout).params)
    ours = reference.flat(otfload_loaded(FAMILY, layout, refs)["params"])
    converted = reference.flat(reference.maxtext_convert(built(FAMILY, layout), refs / FAMILY.checkpoint)["params"])
    assert set(ours) == set(want) == set(converted)
    for name, target in want.items():
        assert (ours[name].shape, ours[name].dtype) == (target.shape, target.dtype), name
        assert ours[name].sharding.is_equivalent_to(target.sharding, target.ndim), name
        np.testing.assert_array_equal(bits(ours[name]), bits(converted[name]), err_msg=name)


def test_maxtext_forward_on_the_drop_in_matches_transformers(refs):
    layout = (True, 1)
    ids = np.load(refs / FAMILY.checkpoint / "ids.npy")
    expected = np.load(refs / FAMILY.checkpoint / "logits.npy")
    got = reference.logits(built(FAMILY, layout), otfload_loaded(FAMILY, layout, refs), ids)
    assert max_rel_diff(got, expected) <= 1e-4, max_rel_diff(got, expected)
