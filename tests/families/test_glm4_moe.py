"""GLM-4.5 / GLM-4.6 (``glm4_moe``): tiny transformers checkpoints → otfload → logits and greedy ids
equal transformers', the export round trip bit-exact, MTP layers never read.

The tiny models keep every feature live: 3 layers with ``first_k_dense_replace=1``, 8 routed
experts in 2 groups with top-2 routing restricted to 1 group and a random correction bias, a shared
expert, routed scaling 2.5, partial rotary (half of each head), q/k/v biases and per-head q/k norms;
the variant has no norms or biases, tied embeddings, every layer MoE and a third of each head rotated."""

import json
import shutil

import numpy as np
import pytest

import otfload
from otfload.errors import ConfigError
from otfload.families.glm4_moe.config import Glm4MoeConfig
from otfload.plan.sharding import make_mesh
from tests.families.checks import (
    MESHES,
    assert_export_round_trip,
    assert_greedy_matches,
    expert_parallel_diff,
    load_sharded,
)
from tests.families.test_deepseek import _randomize_router_bias
from tests.helpers import BASE, max_rel_diff, register_hf_model, rename_tensors, token_ids, torch_logits
from tests.helpers import jax_logits as logits

GLM_BASE = {**BASE, "head_dim": 32, "moe_intermediate_size": 32, "first_k_dense_replace": 1, "n_routed_experts": 8,
            "num_experts_per_tok": 2, "n_shared_experts": 1, "n_group": 2, "topk_group": 1,
            "routed_scaling_factor": 2.5, "use_qk_norm": True, "attention_bias": True}


def _glm4_moe(**kw):
    from transformers import Glm4MoeConfig as HfGlm4MoeConfig
    from transformers import Glm4MoeForCausalLM

    model = Glm4MoeForCausalLM(HfGlm4MoeConfig(**{**GLM_BASE, **kw}))
    _randomize_router_bias(model)
    return model


register_hf_model("glm4_moe", _glm4_moe)
register_hf_model("glm4_moe_plain", _glm4_moe, {
    "use_qk_norm": False, "attention_bias": False, "tie_word_embeddings": True, "first_k_dense_replace": 0,
    "norm_topk_prob": False, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                 "partial_rotary_factor": 0.375}})


@pytest.mark.parametrize(("kind", "scan_layers", "mesh_name"), [
    ("glm4_moe", False, "fsdp2_ep4"), ("glm4_moe", True, "fsdp2_tp4"), ("glm4_moe_plain", True, "fsdp2_ep4"),
    ("glm4_moe_plain", False, "fsdp2_tp4"),
])  # fmt: skip
def test_f32_logits_match_transformers(tiny_checkpoints, kind, scan_layers, mesh_name):
    model, torch_model, mesh = load_sharded(tiny_checkpoints, kind, mesh_name, scan_layers)
    moe = model.moe_layers if scan_layers else model.moe_layers[0]
    assert (model.dense_layers is None) == (kind == "glm4_moe_plain")
    diff = expert_parallel_diff(model, torch_model, mesh, moe.moe.experts.gate.kernel[...], scan_layers)
    assert diff <= 1e-4, diff


def test_partial_rotary_and_routed_scaling_matter(tiny_checkpoints, mesh_2x4):
    """The parity above is not vacuous: full rotary or no routed scaling moves the logits past several
    times the parity bound (the routing rule itself is compared with transformers' router below)."""
    import dataclasses

    path, torch_model = tiny_checkpoints("glm4_moe")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(seq=12)
    ref = torch_logits(torch_model, ids)
    cfg = model.cfg
    for changed in (dataclasses.replace(cfg, rotary_dim=cfg.head_dim),
                    dataclasses.replace(cfg, routed_scaling_factor=1.0)):
        model.cfg = changed
        assert max_rel_diff(logits(model, ids), ref) > 5e-4
    model.cfg = cfg


def test_router_picks_transformers_experts_and_weights(tiny_checkpoints, mesh_2x4):
    """Group-limited sigmoid routing with the correction bias, on 64 random tokens: the same experts
    (sorted) and weights as transformers' ``Glm4MoeTopkRouter``, and the group limit changes the choice."""
    import dataclasses

    import torch

    from otfload.models.deepseek_moe import group_route

    path, torch_model = tiny_checkpoints("glm4_moe")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=False)
    router = {k: np.asarray(v[...]) for k, v in vars(model.moe_layers[0].moe.router).items() if k in ("kernel", "bias")}
    x = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    with torch.no_grad():
        _, ref_w, ref_idx = torch_model.model.layers[1].mlp.gate(torch.tensor(x))
    weights, idx = group_route(router, x, model.cfg)
    order, ref_order = np.argsort(np.asarray(idx), -1), np.argsort(ref_idx.numpy(), -1)
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(idx), order, -1),
                                  np.take_along_axis(ref_idx.numpy(), ref_order, -1))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), order, -1),
                               np.take_along_axis(ref_w.numpy(), ref_order, -1), rtol=1e-6)
    _, ungrouped = group_route(router, x, dataclasses.replace(model.cfg, topk_group=2))
    assert (np.sort(np.asarray(ungrouped), -1) != np.sort(np.asarray(idx), -1)).any()


def test_greedy_decoding_with_the_cache_matches_transformers(tiny_checkpoints, mesh_2x4):
    """Scanned: the cache is the generic one of every family, checked unscanned by other families' tests."""
    path, torch_model = tiny_checkpoints("glm4_moe")
    assert_greedy_matches(otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=True), torch_model)


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("kind", ["glm4_moe", "glm4_moe_plain"])
def test_export_round_trip_is_bit_exact(tiny_checkpoints, mesh_2x4, tmp_path, kind, scan_layers):
    src, _ = tiny_checkpoints(kind)
    model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=scan_layers)
    assert_export_round_trip(model, src, tmp_path / "out")


def test_mtp_layer_is_listed_unused_and_never_read(tiny_checkpoints, mesh_2x4, tmp_path):
    src, torch_model = tiny_checkpoints("glm4_moe")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(src, ckpt)
    assert json.loads((ckpt / "config.json").read_text())["num_nextn_predict_layers"] == 1
    mtp = {"model.layers.3.eh_proj.weight": np.ones((64, 128), np.float32),
           "model.layers.3.mlp.experts.0.up_proj.weight": np.ones((32, 64), np.float32)}
    rename_tensors(ckpt, lambda k: k, mtp)
    model, report = otfload.from_pretrained(ckpt, mesh=mesh_2x4, return_report=True)
    assert report.unused_tensors == sorted(mtp)
    assert report.bytes_read == report.bytes_planned
    ids = token_ids(seq=12)
    assert max_rel_diff(logits(model, ids), torch_logits(torch_model, ids)) <= 1e-4


@pytest.mark.parametrize(("field", "value"), [("hidden_act", "gelu"), ("n_group", 3), ("topk_group", 4),
                                              ("partial_rotary_factor", 0.3),
                                              ("rope_parameters", {"rope_type": "longrope"})])
def test_unsupported_fields_are_refused_by_name(field, value):
    config = {**GLM_BASE, "model_type": "glm4_moe", field: value}
    with pytest.raises(ConfigError) as err:
        Glm4MoeConfig.from_hf(config)
    assert field in err.value.field


def test_peft_lora_merges_like_peft(tiny_checkpoints, tmp_path):
    """A PEFT adapter on the attention, the dense and shared MLPs and the fused routed experts
    (transformers' runtime names, mapped through the family's LoRA layout) merges on the fly: logits
    equal ``PeftModel``'s, and the adapter moves them well past the bound; one on the attention is
    also kept as factors (``merge_adapter=False``), logits again ``PeftModel``'s. Scanned: the merge
    works on the checkpoint's index, before any stacking, and factors are stacked or per layer by the
    generic code tests/adapters/test_factored.py checks with both scan values."""
    from tests.adapters.support import DOWN, GATE_UP, kept_factors, make_adapter, peft_logits

    path, torch_model = tiny_checkpoints("glm4_moe")
    modules, mesh = ["q_proj", "o_proj", "down_proj"], make_mesh(MESHES["fsdp2_ep4"])
    adapter = make_adapter(torch_model, tmp_path / "adapter", r=2, lora_alpha=4, target_modules=modules,
                           target_parameters=[GATE_UP, DOWN])
    ids = token_ids()
    reference = peft_logits(torch_model, [adapter], ids)
    model = otfload.from_pretrained(path, adapter=adapter, mesh=mesh, scan_layers=True)
    assert max_rel_diff(logits(model, ids), reference) <= 1e-4
    assert max_rel_diff(torch_logits(torch_model, ids), reference) > 1e-3
    # kept as factors: the fused experts' factors (target_parameters, where PEFT also puts ``down_proj``)
    # merge only, so they are left out
    kept_adapter = make_adapter(torch_model, tmp_path / "kept", r=2, lora_alpha=4, target_modules=["q_proj", "o_proj"])
    kept = otfload.from_pretrained(path, adapter=kept_adapter, merge_adapter=False, mesh=mesh, scan_layers=True)
    assert kept_factors(kept)
    assert max_rel_diff(logits(kept, ids), peft_logits(torch_model, [kept_adapter], ids)) <= 1e-4
