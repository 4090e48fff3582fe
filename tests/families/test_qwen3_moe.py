"""Qwen3-MoE: tiny transformers checkpoints → otfload → logits equal transformers'. Dense and MoE
layers interleave (``mlp_only_layers``, ``decoder_sparse_step``), so each group is its own stack."""

import numpy as np
import pytest

import otfload
from otfload.families.qwen3_moe.config import qwen3_moe_config
from tests.families.moe_helpers import MOE_BASE, check_parity, parity_cases, wrong_shape_error
from tests.helpers import hf_tensors, register_hf_model


def _qwen3_moe(**kw):
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = {**MOE_BASE, "num_experts": 4, "moe_intermediate_size": 32, "head_dim": 32, **kw}
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg))


# layers: MoE, dense, MoE (mlp_only_layers) and dense, MoE, dense (decoder_sparse_step=2).
register_hf_model("qwen3_moe", _qwen3_moe, {"mlp_only_layers": [1], "norm_topk_prob": False})
register_hf_model("qwen3_moe_tied_step2", _qwen3_moe,
                  {"decoder_sparse_step": 2, "norm_topk_prob": True, "tie_word_embeddings": True})


@pytest.mark.parametrize(("kind", "scan_layers", "mesh_name"), parity_cases("qwen3_moe", "qwen3_moe_tied_step2"))
def test_f32_logits_match_transformers(tiny_checkpoints, kind, scan_layers, mesh_name):
    diff = check_parity(tiny_checkpoints, kind, mesh_name, scan_layers)
    assert diff <= 1e-4, diff


def test_layer_groups_follow_transformers_rule():
    base = {**MOE_BASE, "model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 32,
            "num_hidden_layers": 6}
    cfg = qwen3_moe_config({**base, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert (cfg.moe_layers, cfg.dense_layers) == ((1, 5), (0, 2, 3, 4))
    assert qwen3_moe_config(base).moe_layers == tuple(range(6))


def test_groups_are_stacked_from_their_hf_layers(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("qwen3_moe")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=True)
    hf = hf_tensors(path)
    q = "model.layers.{}.self_attn.q_norm.weight"
    np.testing.assert_array_equal(np.asarray(model.layers.attn.q_norm.scale[...]), np.stack([hf[q.format(0)],
                                                                                             hf[q.format(2)]]))
    np.testing.assert_array_equal(np.asarray(model.dense_layers.attn.q_norm.scale[...]), hf[q.format(1)][None])
    assert model.layers.moe.up.kernel[...].shape == (2, 4, 32, 64)
    assert model.dense_layers.mlp.up.kernel[...].shape == (1, 128, 64)


def test_wrong_shaped_expert_names_expert_layer_and_leaf(tiny_checkpoints, tmp_path):
    key = "model.layers.2.mlp.experts.3.down_proj.weight"
    err = wrong_shape_error(tiny_checkpoints, tmp_path, "qwen3_moe", key, (64, 31))
    (problem,) = err.mismatched
    assert problem.leaf == "layers.moe.down.kernel"
    assert "(64, 32)" in str(err) and "(64, 31)" in str(err)
