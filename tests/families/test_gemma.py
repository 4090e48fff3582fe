"""Gemma 2 and Gemma 3 (text): tiny transformers checkpoints → otfload → logits equal transformers'."""

import json
import shutil

import numpy as np
import pytest

import otfload
from otfload.errors import ShapeMismatchError
from otfload.families.gemma.config import GemmaConfig
from tests.helpers import BASE, max_rel_diff, module_name, register_hf_model, rename_tensors, token_ids, torch_logits
from tests.helpers import jax_logits as logits

# 4 layers, a window of 4 and 12-token inputs: sliding and global layers both occur and differ.
# head_dim and query_pre_attn_scalar differ from hidden/heads so a wrong scale shows; small
# soft-caps make the tanh bite on these small random weights.
GEMMA_BASE = {**BASE, "num_hidden_layers": 4, "head_dim": 32, "sliding_window": 4, "query_pre_attn_scalar": 24}
SLIDING, FULL = "sliding_attention", "full_attention"


def _gemma2(**kw):
    from transformers import Gemma2Config, Gemma2ForCausalLM

    cfg = {**GEMMA_BASE, "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0, **kw}
    return Gemma2ForCausalLM(Gemma2Config(**cfg))


def _gemma3(**kw):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    rope = {FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}, SLIDING: {"rope_type": "default",
                                                                                       "rope_theta": 1e4}}
    cfg = {**GEMMA_BASE, "layer_types": [SLIDING, SLIDING, FULL, SLIDING], "rope_parameters": rope, **kw}
    return Gemma3ForCausalLM(Gemma3TextConfig(**cfg))


def _gemma3_multimodal(**kw):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    rope = {FULL: {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6}, SLIDING: {"rope_type": "default",
                                                                                       "rope_theta": 1e4}}
    text = {**GEMMA_BASE, "layer_types": [SLIDING, SLIDING, FULL, SLIDING], "rope_parameters": rope, **kw}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": 28, "patch_size": 14}
    return Gemma3ForConditionalGeneration(Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4))


register_hf_model("gemma2", _gemma2)
register_hf_model("gemma3_multimodal", _gemma3_multimodal)
register_hf_model("gemma2_untied_bias", _gemma2, {"tie_word_embeddings": False, "attention_bias": True})
register_hf_model("gemma3_text", _gemma3)

KINDS = ["gemma2", "gemma2_untied_bias", "gemma3_text"]




@pytest.mark.parametrize("scan_layers", [True, False])
def test_multimodal_gemma3_loads_its_text_model_and_skips_the_vision_tower(tiny_checkpoints, mesh_2x4, scan_layers):
    path, torch_model = tiny_checkpoints("gemma3_multimodal")
    keys = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    vision = sorted(k for k in keys if not k.startswith("language_model."))
    assert vision and any(k.startswith("language_model.model.layers.") for k in keys)
    model, report = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=scan_layers, return_report=True)
    assert report.unused_tensors == vision  # vision tower and projector: listed, never read
    assert report.bytes_read == report.bytes_planned
    ids = token_ids(seq=12)  # text only: the language model's logits
    diff = max_rel_diff(logits(model, ids), torch_logits(torch_model, ids))
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_f32_logits_match_transformers(tiny_checkpoints, mesh_2x4, kind, scan_layers):
    path, torch_model = tiny_checkpoints(kind)
    assert len(list(path.glob("*.safetensors"))) > 1
    tied = torch_model.config.tie_word_embeddings
    assert ("lm_head.weight" in json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]) != tied
    model = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=scan_layers)
    if scan_layers:  # one stack per leaf although sliding and global layers alternate
        assert model.layers.pre_ffw_norm.scale[...].shape == (4, 64)
    ids = token_ids(seq=12)
    diff = max_rel_diff(logits(model, ids), torch_logits(torch_model, ids))
    assert diff <= 1e-4, diff


def test_sliding_pattern_and_rope_per_type_matter(tiny_checkpoints, mesh_2x4):
    """The parity above is not vacuous: treating every layer as global changes the logits."""
    import dataclasses

    path, torch_model = tiny_checkpoints("gemma3_text")
    model = otfload.from_pretrained(path, mesh=mesh_2x4)
    ids = token_ids(seq=12)
    ref = torch_logits(torch_model, ids)
    model.cfg = dataclasses.replace(model.cfg, layer_types=(FULL,) * 4)
    assert max_rel_diff(logits(model, ids), ref) > 1e-3


def _legacy_pairs():
    """Configs as older checkpoints on the Hub write them, without per-type ``rope_parameters``,
    and leaving head_dim, the window and the soft-caps to the class defaults."""
    common = {**BASE, "num_hidden_layers": 7}
    gemma3 = {**common, "model_type": "gemma3_text", "rope_theta": 1e6, "rope_local_base_freq": 1e4,
              "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "sliding_window_pattern": 3}
    gemma2 = {**common, "model_type": "gemma2", "rope_theta": 5e4}
    return [("gemma3_text", gemma3), ("gemma2", gemma2)]


@pytest.mark.parametrize(("model_type", "legacy"), _legacy_pairs(), ids=["gemma3_text", "gemma2"])
def test_legacy_config_fields_parse_as_transformers_reads_them(model_type, legacy):
    from transformers import AutoConfig

    fields = {k: v for k, v in legacy.items() if k != "model_type"}
    normalised = AutoConfig.for_model(model_type, **fields).to_dict()
    ours, theirs = GemmaConfig.from_hf(legacy), GemmaConfig.from_hf(normalised)
    assert ours == theirs
    assert ours.rope_global != ours.rope_local or model_type == "gemma2"
    assert ours.layer_types.count(FULL) == (2 if model_type == "gemma3_text" else 3)


def test_wrong_shaped_tensor_names_key_and_leaf(tiny_checkpoints, tmp_path):
    from safetensors.numpy import load_file, save_file

    src, _ = tiny_checkpoints("gemma3_text")
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    key = "model.layers.2.self_attn.q_norm.weight"
    shard = path / json.loads((path / "model.safetensors.index.json").read_text())["weight_map"][key]
    tensors = load_file(shard)
    tensors[key] = np.zeros((31,), np.float32)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(ShapeMismatchError) as err:
        otfload.from_pretrained(path, scan_layers=True)
    (problem,) = err.value.mismatched
    assert problem.hf_key == key and problem.leaf == "layers.attn.q_norm.scale"
    assert "(32,)" in str(err.value) and "(31,)" in str(err.value)


def test_multimodal_gemma3_under_transformers_module_names_loads_the_same(tiny_checkpoints, mesh_2x4, tmp_path):
    src, torch_model = tiny_checkpoints("gemma3_multimodal")
    path = tmp_path / "ckpt"
    shutil.copytree(src, path)
    rename_tensors(path, module_name)
    keys = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert any(k.startswith("model.language_model.layers.") for k in keys)
    assert not any(k.startswith("language_model.") for k in keys)
    model, report = otfload.from_pretrained(path, mesh=mesh_2x4, return_report=True)
    assert report.unused_tensors == sorted(k for k in keys if not k.startswith("model.language_model."))
    ids = token_ids(seq=12)
    diff = max_rel_diff(logits(model, ids), torch_logits(torch_model, ids))
    assert diff <= 1e-4, diff


def test_multimodal_gemma3_with_quantization_config_in_text_config(tiny_checkpoints, mesh_2x4, tmp_path):
    """The language model's linears in compressed-tensors FP8 (per channel), the config nested in
    ``text_config``: logits equal transformers' text path on the dequantised weights. Scanned: the
    weights are dequantised as they are read, before any stacking."""
    from tests.index.quant import layouts

    src, torch_model = tiny_checkpoints("gemma3_multimodal")
    path = tmp_path / "ckpt"
    reference = layouts.quantize_checkpoint(src, path, lambda k: k.startswith("language_model.") and
                                            layouts.is_linear(k), layouts.compressed_tensors("fp8_channel"), None)
    config = json.loads((path / "config.json").read_text())
    config["text_config"]["quantization_config"] = layouts.ct_config("fp8_channel", ignore=["re:.*lm_head"])
    (path / "config.json").write_text(json.dumps(config))
    reference_model = layouts.load_reference(torch_model, reference, src, tmp_path / "reference")
    model, report = otfload.from_pretrained(path, mesh=mesh_2x4, scan_layers=True, dtype="float32",
                                            return_report=True)
    assert not any(k.startswith("language_model.") for k in report.unused_tensors)  # every scale was used
    ids = token_ids(seq=12)
    diff = max_rel_diff(logits(model, ids), torch_logits(reference_model, ids))
    assert diff <= 1e-4, diff
    assert max_rel_diff(logits(model, ids), torch_logits(torch_model, ids)) > 1e-3  # FP8 changed the weights
