"""GPT-OSS: tiny transformers checkpoints → otfload → logits equal transformers'. Fused, interleaved
gate/up experts with biases, a biased router, attention sinks, alternating sliding/full attention
and the default YaRN RoPE."""

import dataclasses

import numpy as np
import pytest

import otfload
from tests.families.moe_helpers import MOE_BASE, check_parity, parity_cases, wrong_shape_error
from tests.helpers import hf_tensors, max_rel_diff, register_hf_model, token_ids, torch_logits
from tests.helpers import jax_logits as logits


def _gpt_oss(**kw):
    from transformers import GptOssConfig, GptOssForCausalLM

    # A window of 4 on 12-token inputs so sliding and full layers differ.
    return GptOssForCausalLM(GptOssConfig(**{**MOE_BASE, "num_local_experts": 4, "head_dim": 16,
                                             "sliding_window": 4, **kw}))


register_hf_model("gpt_oss", _gpt_oss)
register_hf_model("gpt_oss_tied", _gpt_oss, {"tie_word_embeddings": True})


@pytest.mark.parametrize(("kind", "scan_layers", "mesh_name"), parity_cases("gpt_oss", "gpt_oss_tied"))
def test_f32_logits_match_transformers(tiny_checkpoints, kind, scan_layers, mesh_name):
    diff = check_parity(tiny_checkpoints, kind, mesh_name, scan_layers)
    assert diff <= 1e-4, diff


def test_gate_and_up_are_the_interleaved_columns(tiny_checkpoints, mesh_2x4):
    path, _ = tiny_checkpoints("gpt_oss")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=False)
    hf = hf_tensors(path)
    fused, bias = hf["model.layers.2.mlp.experts.gate_up_proj"], hf["model.layers.2.mlp.experts.gate_up_proj_bias"]
    moe = model.layers[2].moe
    np.testing.assert_array_equal(np.asarray(moe.gate.kernel[...]), fused[..., ::2])
    np.testing.assert_array_equal(np.asarray(moe.up.kernel[...]), fused[..., 1::2])
    np.testing.assert_array_equal(np.asarray(moe.up.bias[...]), bias[..., 1::2])


def test_sinks_sliding_layers_and_yarn_each_matter(tiny_checkpoints, mesh_2x4):
    """The parity above is not vacuous: dropping any of the three changes the logits."""
    path, torch_model = tiny_checkpoints("gpt_oss")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(seq=12)
    ref = torch_logits(torch_model, ids)
    cfg = model.cfg
    for change in ({"sliding_layers": ()}, {"rope_scaling": None}):
        model.cfg = dataclasses.replace(cfg, **change)
        assert max_rel_diff(logits(model, ids), ref) > 1e-3, change
    model.cfg = cfg
    model.layers.attn.sinks[...] = np.full(model.layers.attn.sinks[...].shape, -1e9, np.float32)
    assert max_rel_diff(logits(model, ids), ref) > 1e-3


def test_wrong_shaped_fused_experts_name_key_and_both_leaves(tiny_checkpoints, tmp_path):
    key = "model.layers.1.mlp.experts.gate_up_proj"
    err = wrong_shape_error(tiny_checkpoints, tmp_path, "gpt_oss", key, (3, 64, 256))
    assert {p.leaf for p in err.mismatched} == {"layers.moe.gate.kernel", "layers.moe.up.kernel"}
    assert "(4, 64, 128)" in str(err) and "(3, 64, 256)" in str(err)
