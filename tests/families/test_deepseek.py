"""DeepSeek-V2 and DeepSeek-V3: tiny transformers checkpoints → otfload → logits equal transformers'.

The tiny models keep every feature live: 3 layers with ``first_k_dense_replace=1`` (one dense
layer, two MoE layers), 4 routed experts in 2 groups with top-2 routing restricted to 1 group, a
shared expert, MLA with small lora ranks (V3 with ``q_lora_rank``, V2 without) and YaRN RoPE whose
attention factor and softmax ``mscale`` both differ from 1 (large ``mscale`` values sharpen the
attention of these small random weights, so RoPE details show in the logits).
"""

import json
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

import otfload
from otfload.errors import ShapeMismatchError
from tests.families.checks import expert_parallel_diff, load_sharded
from tests.helpers import jax_logits as logits
from tests.helpers import max_rel_diff, register_hf_model, token_ids, torch_logits

DEEPSEEK_BASE = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
    first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
    num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1, kv_lora_rank=16, qk_nope_head_dim=16,
    qk_rope_head_dim=8, v_head_dim=16, max_position_embeddings=128,
)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32, "beta_slow": 1, "mscale": 40.0, "mscale_all_dim": 20.0}


def _randomize_router_bias(model) -> None:
    """``e_score_correction_bias`` is a buffer (zeros by default): make it matter."""
    import torch

    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape, generator=gen) * 0.1)


def _deepseek_v2(**kw):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    cfg = {**DEEPSEEK_BASE, "q_lora_rank": None, "topk_method": "group_limited_greedy",
           "routed_scaling_factor": 1.5, "rope_parameters": {**YARN, "mscale": 20.0, "mscale_all_dim": 20.0}, **kw}
    return DeepseekV2ForCausalLM(DeepseekV2Config(**cfg))


def _deepseek_v3(**kw):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = {**DEEPSEEK_BASE, "q_lora_rank": 24, "routed_scaling_factor": 2.5, "rope_parameters": YARN, **kw}
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**cfg))
    _randomize_router_bias(model)
    return model


register_hf_model("deepseek_v2", _deepseek_v2)
register_hf_model("deepseek_v3", _deepseek_v3)
# The other V3 variants: plain rotate-half RoPE, tied embeddings, no group limit, no normalisation.
register_hf_model("deepseek_v3_plain", _deepseek_v3, {"rope_interleave": False, "tie_word_embeddings": True,
                                                      "n_group": 1, "norm_topk_prob": False,
                                                      "rope_parameters": {"rope_type": "default",
                                                                          "rope_theta": 10000.0}})





def _hf_tensors(path) -> dict[str, np.ndarray]:
    tensors = {}
    for f in path.glob("*.safetensors"):
        tensors.update(load_file(f))
    return tensors


# Each version with both scan values and both meshes, each scan value on both meshes: not every triple.
@pytest.mark.parametrize(("kind", "scan_layers", "mesh_name"), [
    ("deepseek_v2", True, "fsdp2_tp4"), ("deepseek_v2", False, "fsdp2_ep4"),
    ("deepseek_v3", True, "fsdp2_ep4"), ("deepseek_v3", False, "fsdp2_tp4"),
])  # fmt: skip
def test_f32_logits_match_transformers(tiny_checkpoints, kind, scan_layers, mesh_name):
    model, torch_model, mesh = load_sharded(tiny_checkpoints, kind, mesh_name, scan_layers)
    dense = model.dense_layers if scan_layers else model.dense_layers[0]
    moe = model.moe_layers if scan_layers else model.moe_layers[1]
    experts = moe.moe.experts.gate.kernel[...]
    # (layers, experts, moe_inter, hidden) scanned, (experts, ...) unscanned; experts on "ep" when present.
    assert experts.shape == ((2,) if scan_layers else ()) + (4, 32, 64)
    assert dense.mlp.up.kernel[...].shape == ((1,) if scan_layers else ()) + (128, 64)
    assert hasattr(moe.attn, "q_a") == (kind == "deepseek_v3")
    diff = expert_parallel_diff(model, torch_model, mesh, experts, scan_layers)
    assert diff <= 1e-4, diff


def test_v3_plain_rope_tied_ungrouped_matches(tiny_checkpoints, mesh_2x4):
    path, torch_model = tiny_checkpoints("deepseek_v3_plain")
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert "lm_head.weight" not in weight_map
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=True)
    assert not hasattr(model, "lm_head")
    ids = token_ids(seq=12)
    diff = max_rel_diff(logits(model, ids), torch_logits(torch_model, ids))
    assert diff <= 1e-4, diff


def test_parity_is_not_vacuous(tiny_checkpoints, mesh_2x4):
    """Each DeepSeek-specific feature changes the logits well past the parity bound, so the parity
    tests really check it."""
    import dataclasses

    path, torch_model = tiny_checkpoints("deepseek_v3")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(seq=12)
    ref = torch_logits(torch_model, ids)
    base = model.cfg
    changes = [
        {"rope_interleave": False},  # the rotary pair layout
        {"rope_scaling": None},  # YaRN frequencies, attention factor and softmax mscale
        {"n_group": 1},  # group-limited routing (with the correction bias)
    ]
    for change in changes:
        model.cfg = dataclasses.replace(base, **change)
        assert max_rel_diff(logits(model, ids), ref) > 1e-3, change


def test_split_leaves_hold_their_part_of_fused_tensors(tiny_checkpoints, mesh_2x4):
    """kv_a_proj_with_mqa → kv_a + k_rope and kv_b_proj → k_b + v_b, and the MoE group's offset."""
    path, _ = tiny_checkpoints("deepseek_v3")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=True)
    hf = _hf_tensors(path)
    attn = model.moe_layers.attn
    kv_a = hf["model.layers.2.self_attn.kv_a_proj_with_mqa.weight"]
    np.testing.assert_array_equal(np.asarray(attn.kv_a.kernel[...])[1], kv_a[:16])
    np.testing.assert_array_equal(np.asarray(attn.k_rope.kernel[...])[1], kv_a[16:])
    kv_b = hf["model.layers.1.self_attn.kv_b_proj.weight"].reshape(4, 32, 16)
    np.testing.assert_array_equal(np.asarray(attn.k_b.kernel[...])[0], kv_b[:, :16])
    np.testing.assert_array_equal(np.asarray(attn.v_b.kernel[...])[0], kv_b[:, 16:])
    down = np.asarray(model.moe_layers.moe.experts.down.kernel[...])
    np.testing.assert_array_equal(down[1, 3], hf["model.layers.2.mlp.experts.3.down_proj.weight"])


def _add_mtp_layer(src, dst) -> list[str]:
    """Copy the checkpoint and add a V3 MTP layer (HF index ``num_hidden_layers`` = 3) in its own file."""
    shutil.copytree(src, dst)
    hf = _hf_tensors(src)
    mtp = {k.replace("model.layers.2.", "model.layers.3."): v for k, v in hf.items() if k.startswith("model.layers.2.")}
    for name, like in (("embed_tokens", "model.embed_tokens.weight"), ("shared_head.head", "lm_head.weight")):
        mtp[f"model.layers.3.{name}.weight"] = hf[like]
    for name in ("enorm", "hnorm", "shared_head.norm"):
        mtp[f"model.layers.3.{name}.weight"] = hf["model.norm.weight"]
    mtp["model.layers.3.eh_proj.weight"] = np.ones((64, 128), np.float32)
    save_file(mtp, str(dst / "model-mtp.safetensors"))
    index_path = dst / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"].update(dict.fromkeys(mtp, "model-mtp.safetensors"))
    index_path.write_text(json.dumps(index))
    return sorted(mtp)


def test_mtp_layer_is_unused_and_never_read(tiny_checkpoints, mesh_2x4, tmp_path):
    path, _ = tiny_checkpoints("deepseek_v3")
    mtp_keys = _add_mtp_layer(path, tmp_path / "with_mtp")
    _, report = otfload.from_pretrained(tmp_path / "with_mtp", mesh=mesh_2x4, return_report=True)
    _, plain = otfload.from_pretrained(path, mesh=mesh_2x4, return_report=True)
    assert report.unused_tensors == mtp_keys and plain.unused_tensors == []
    assert "model-mtp.safetensors" not in report.files
    # The MTP layer costs nothing: exactly the reads of the checkpoint without it.
    assert (report.tensors_read, report.bytes_read) == (plain.tensors_read, plain.bytes_read)
    assert report.bytes_planned == plain.bytes_planned


def test_wrong_shaped_expert_names_key_and_leaf(tiny_checkpoints, mesh_2x4, tmp_path):
    path, _ = tiny_checkpoints("deepseek_v2")
    bad = tmp_path / "bad"
    shutil.copytree(path, bad)
    key = "model.layers.2.mlp.experts.3.up_proj.weight"
    file = json.loads((bad / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(bad / file)
    tensors[key] = np.zeros((31, 64), np.float32)
    save_file(tensors, str(bad / file), metadata={"format": "pt"})
    with pytest.raises(ShapeMismatchError) as err:
        otfload.from_pretrained(bad, mesh=mesh_2x4, scan_layers=True)
    assert [(p.hf_key, p.leaf) for p in err.value.problems] == [(key, "moe_layers.moe.experts.up.kernel")]
    assert key in str(err.value) and "moe_layers.moe.experts.up.kernel" in str(err.value)


# The RoPE fields of the published configs, in their legacy ``rope_scaling`` form.
V2_LITE = {"model_type": "deepseek_v2", "q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
           "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}}
V3_671B = {"model_type": "deepseek_v3", "q_lora_rank": 1536, "topk_method": "noaux_tc", "n_group": 8, "topk_group": 4,
           "n_routed_experts": 256,  # 8 groups need more than DEEPSEEK_BASE's 4 experts
           "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                            "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1}}


@pytest.mark.parametrize("published", [V2_LITE, V3_671B], ids=["v2_lite", "v3"])
def test_published_rope_configs_match_transformers(published):
    """RoPE frequencies, cos/sin factor and softmax scale at the real sizes (64 rope dims, factor 40)."""
    import importlib

    from otfload.families.deepseek.config import DeepseekConfig
    from otfload.models.layers import rope_attention_factor, rope_inv_freq
    from otfload.models.mla import softmax_scale

    hf = {**DEEPSEEK_BASE, "max_position_embeddings": 163840, "rope_theta": 10000, "qk_nope_head_dim": 128,
          "qk_rope_head_dim": 64, **published}
    version = hf["model_type"].split("_")[1]
    module = importlib.import_module(f"transformers.models.deepseek_{version}.modeling_deepseek_{version}")
    config_cls = getattr(importlib.import_module("transformers"), f"Deepseek{version.upper()}Config")
    ref_cfg = config_cls(**{k: v for k, v in hf.items() if k != "model_type"})
    rotary = getattr(module, f"Deepseek{version.upper()}RotaryEmbedding")(ref_cfg)
    ours = DeepseekConfig.from_hf(hf)
    inv = rope_inv_freq(ours.qk_rope_head_dim, ours.rope_theta, ours.rope_scaling)
    np.testing.assert_allclose(inv, rotary.inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(ours.rope_scaling) == pytest.approx(rotary.attention_scaling)
    assert softmax_scale(ours) == pytest.approx(module.yarn_apply_mscale(ref_cfg.rope_parameters, 192**-0.5))
    assert softmax_scale(ours) != pytest.approx(192**-0.5)


@pytest.mark.parametrize("change", [{"attention_bias": True}, {"mlp_bias": True}, {"topk_method": "noaux_tc"}])
def test_unsupported_variants_raise_a_typed_error(change):
    from otfload.errors import UnsupportedModelError
    from otfload.families.deepseek.config import DeepseekConfig

    hf = {**DEEPSEEK_BASE, **V2_LITE, "rope_theta": 10000, **change}
    DeepseekConfig.from_hf({**DEEPSEEK_BASE, **V2_LITE, "rope_theta": 10000})  # the unchanged config parses
    with pytest.raises(UnsupportedModelError, match=next(iter(change))):
        DeepseekConfig.from_hf(hf)
