"""Gemma 4 against the real MaxText (maxtext 0.2.5, its venv): the tree ``otfload.maxtext`` builds and
loads for ``gemma4-26b`` (MoE) and ``gemma4-31b`` (dense) is MaxText's own abstract tree — every leaf
path, shape and sharding, scanned at either ``param_scan_axis``, with and without a remainder block
(12 layers: two blocks; 13: one left over, ``layers_remainder.local_layers``). The values are
``tests/maxtext_tables/test_gemma4.py``'s numpy; no tiny Gemma 4 checkpoint is in ``make_refs.py`` yet."""

from __future__ import annotations

import pytest

pytest.importorskip("maxtext", reason="MaxText is not installed (its own venv: scripts/make_maxtext_venv.sh)")
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

import otfload.maxtext as mx  # noqa: E402
from tests.maxtext import reference  # noqa: E402
from tests.maxtext.models import Family  # noqa: E402

DIMS = dict(emb_dim=64, num_query_heads=8, num_kv_heads=4, head_dim=16, global_head_dim=32, global_num_kv_heads=4,
            mlp_dim=128, vocab_size=256)
MOE = dict(num_experts=8, moe_mlp_dim=32)


def _family(moe: bool, layers: int) -> Family:
    base = {f"base_{k}" if k in ("emb_dim", "num_query_heads", "num_kv_heads", "mlp_dim") else k: v
            for k, v in DIMS.items()}
    experts = dict(num_experts=MOE["num_experts"], num_experts_per_tok=2, base_moe_mlp_dim=MOE["moe_mlp_dim"])
    extra = {**base, **(experts if moe else {}), "base_num_decoder_layers": layers}
    return Family("gemma4", "gemma4-26b" if moe else "gemma4-31b", "Gemma4Config", "Gemma4ForConditionalGeneration",
                  tied=True, moe=moe, maxtext_extra=extra)


@pytest.mark.parametrize(("moe", "axis", "layers"), [(True, 1, 13), (True, 0, 12), (False, 1, 12), (False, 0, 13)])
def test_the_tree_is_maxtexts(moe, axis, layers):
    family = _family(moe, layers)
    built = reference.build(family, True, axis)
    want = reference.flat(built.params)
    cfg = dict(DIMS, **MOE, model_name=family.model_name, scan_layers=True, param_scan_axis=axis,
               num_decoder_layers=layers, logits_via_embedding=True)
    ours = reference.flat(mx.abstract_params(cfg, built.mesh))
    assert sorted(ours) == sorted(want)
    for name, target in want.items():
        assert ours[name].shape == target.shape, name
        assert ours[name].sharding.is_equivalent_to(target.sharding, target.ndim), name
