"""DeepSeek-V3.2 (``deepseek3.2-671b``) scanned, against the real MaxText (maxtext 0.2.5, its venv).

``test_maxtext_drop_in.py`` has the unscanned tree (every leaf bitwise MaxText's loader's) and MaxText's
forward on the drop-in's scanned tree (``param_scan_axis`` 1) within 1e-4 of transformers'. Scanned,
MaxText's own loader cannot load V3.2: the indexer's ``k_norm`` is an ``nnx.LayerNorm`` with no
logical axes, so its scanned scale and bias have the sharding ``PartitionSpec()``, and
``tensor_handling._build_single_axis_stacked_tensor`` deletes the stacking axis from that empty spec
(an ``IndexError``) at either ``param_scan_axis``. There the reference is MaxText's loader's
unscanned leaves (bitwise the drop-in's there) stacked as MaxText's scanned tree lays them out: the
layer axis at ``param_scan_axis``, the routing bias (a ``MoEBiasVar``) at 0; the shapes and
shardings are MaxText's abstract tree's.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed (its own venv: scripts/make_maxtext_venv.sh)")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

from tests.maxtext import reference  # noqa: E402
from tests.maxtext.models import FAMILIES  # noqa: E402
from tests.maxtext.test_maxtext_drop_in import ROUTING_BIAS, bits, built, maxtext_loaded, otfload_loaded  # noqa: E402

DS32, UNSCANNED = FAMILIES["deepseek32"], (False, 1)
SCANNED = [(True, 1), (True, 0)]


@pytest.mark.parametrize("layout", SCANNED, ids=["axis1", "axis0"])
def test_maxtext_loader_cannot_load_scanned_deepseek32(layout, refs):
    """The fact behind the stacked reference below."""
    b = built(DS32, layout)
    k_norm = reference.flat(b.params)["decoder.dense_layers.self_attention.indexer.k_norm.bias"]
    assert tuple(k_norm.sharding.spec) == ()
    with pytest.raises(IndexError, match="list assignment index out of range"):
        reference.maxtext_load(b, refs / DS32.checkpoint)


def _expected(unscanned: dict, path: str, layers: dict[str, int], axis: int) -> np.ndarray:
    """MaxText's unscanned leaves of a scanned ``path`` stacked (the layer axis at ``axis``, the routing
    bias at 0), or its leaf outside the layers."""
    for group, count in layers.items():
        if path.startswith(f"{group}."):
            name = path.removeprefix(f"{group}.")
            at = 0 if name.endswith(ROUTING_BIAS) else axis
            return np.stack([np.asarray(unscanned[f"{group}_{i}.{name}"]) for i in range(count)], axis=at)
    return np.asarray(unscanned[path])


@pytest.mark.parametrize("layout", SCANNED, ids=["axis1", "axis0"])
def test_scanned_drop_in_is_maxtexts_unscanned_leaves_stacked(layout, refs):
    b = built(DS32, layout)
    want = reference.flat(b.params)
    ours = reference.flat(otfload_loaded(DS32, layout, refs)["params"])
    theirs = reference.flat(maxtext_loaded(DS32, UNSCANNED, refs)["params"])
    dense = b.config.first_num_dense_layers
    layers = {"decoder.dense_layers": dense, "decoder.moe_layers": b.config.num_decoder_layers - dense}
    assert set(ours) == set(want)
    for path, target in want.items():
        leaf = ours[path]
        assert (leaf.shape, leaf.dtype) == (target.shape, target.dtype), path
        assert leaf.sharding.is_equivalent_to(target.sharding, leaf.ndim), path
        np.testing.assert_array_equal(bits(leaf), bits(_expected(theirs, path, layers, layout[1])), err_msg=path)
