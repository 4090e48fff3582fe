"""Mixtral: tiny transformers checkpoints → otfload → logits equal transformers'."""

import numpy as np
import pytest

import otfload
from tests.families.moe_helpers import MOE_BASE, check_parity, parity_cases, wrong_shape_error
from tests.helpers import hf_tensors, register_hf_model


def _mixtral(**kw):
    from transformers import MixtralConfig, MixtralForCausalLM

    return MixtralForCausalLM(MixtralConfig(**{**MOE_BASE, "num_local_experts": 4, **kw}))


register_hf_model("mixtral", _mixtral)
register_hf_model("mixtral_tied_window", _mixtral, {"tie_word_embeddings": True, "sliding_window": 4})


@pytest.mark.parametrize(("kind", "scan_layers", "mesh_name"), parity_cases("mixtral", "mixtral_tied_window"))
def test_f32_logits_match_transformers(tiny_checkpoints, kind, scan_layers, mesh_name):
    diff = check_parity(tiny_checkpoints, kind, mesh_name, scan_layers)
    assert diff <= 1e-4, diff


def test_experts_are_stacked_in_expert_order(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("mixtral")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=True)
    hf = hf_tensors(path)
    want = np.stack([np.stack([hf[f"model.layers.{i}.block_sparse_moe.experts.{e}.w2.weight"] for e in range(4)])
                     for i in range(3)])
    np.testing.assert_array_equal(np.asarray(model.layers.moe.down.kernel[...]), want)


def test_wrong_shaped_expert_names_expert_layer_and_leaf(tiny_checkpoints, tmp_path):
    key = "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    err = wrong_shape_error(tiny_checkpoints, tmp_path, "mixtral", key, (127, 64))
    (problem,) = err.mismatched
    assert problem.leaf == "layers.moe.gate.kernel"
    assert "(128, 64)" in str(err) and "(127, 64)" in str(err)
