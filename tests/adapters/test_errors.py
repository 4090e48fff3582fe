"""Every adapter otfload cannot merge faithfully is a typed ``AdapterError`` naming the adapter, the
module and the field — raised while planning, before any tensor byte is read."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

import otfload
from otfload.adapters.config import UNSUPPORTED_FLAGS, parse_adapter_config
from otfload.errors import AdapterError, UnsafeFormatError
from tests.adapters.support import lora_pair, write_adapter

Q = "model.layers.0.self_attn.q_proj"  # [64, 64] in the tiny llama
K = "model.layers.1.self_attn.k_proj"  # [32, 64]


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints("llama")[0]


def plan_error(base, adapter, **kw) -> str:
    with pytest.raises(AdapterError) as err:
        otfload.plan_model(base, adapter=adapter, **kw)
    return str(err.value)


@pytest.mark.parametrize(("config", "field"), [
    ({"peft_type": "PREFIX_TUNING"}, "peft_type"),
    ({"peft_type": "IA3"}, "peft_type"),
    ({"use_dora": True}, "use_dora"),
    ({"lora_bias": True}, "lora_bias"),
    ({"bias": "all"}, "bias"),
    ({"bias": "lora_only"}, "bias"),
    ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    ({"layer_replication": [[0, 2], [1, 3]]}, "layer_replication"),
    ({"r": "4"}, "r"),
    ({"lora_alpha": "high"}, "lora_alpha"),
    ({"rank_pattern": {"q_proj(": 8}}, "rank_pattern"),
    ({"alpha_pattern": {"q_proj": "x"}}, "alpha_pattern"),
    ({"init_lora_weights": "mica"}, "init_lora_weights"),
])
def test_unsupported_or_malformed_config_fields(llama, tmp_path, config, field):
    adapter = write_adapter(tmp_path / "a", lora_pair(Q, 4, 64, 64), **config)
    message = plan_error(llama, adapter)
    assert f"field {field!r}" in message and str(adapter) in message


@pytest.mark.parametrize("flag", sorted(UNSUPPORTED_FLAGS))
def test_every_variant_flag_is_refused(flag):
    with pytest.raises(AdapterError, match=f"field '{flag}'"):
        parse_adapter_config({"peft_type": "LORA", "r": 4, flag: {"enabled": 1}}, "here")


def test_config_rank_disagreeing_with_the_tensors(llama, tmp_path):
    adapter = write_adapter(tmp_path / "r", lora_pair(Q, 4, 64, 64), r=8)
    message = plan_error(llama, adapter)
    assert Q in message and "field r" in message and "is 8" in message and "rank 4" in message
    adapter = write_adapter(tmp_path / "pattern", lora_pair(Q, 4, 64, 64), r=4, rank_pattern={"q_proj": 2})
    assert "field r (with rank_pattern) is 2" in plan_error(llama, adapter)


def test_factors_that_do_not_fit_the_base_module(llama, tmp_path):
    adapter = write_adapter(tmp_path / "a", {**lora_pair(Q, 4, 64, 64), **lora_pair(K, 4, 64, 64)})
    message = plan_error(llama, adapter)
    assert K in message and "[32, 64]" in message and "do not fit" in message
    pair = lora_pair(Q, 4, 64, 64)
    pair[f"{Q}.lora_B.weight"] = pair[f"{Q}.lora_B.weight"][:, :3]
    assert "disagree on the rank" in plan_error(llama, write_adapter(tmp_path / "b", pair))
    del pair[f"{Q}.lora_B.weight"]
    assert "has no lora_B" in plan_error(llama, write_adapter(tmp_path / "c", pair))


@pytest.mark.parametrize("module", ["model.layers.0.self_attn.qkv_proj", "model.layers.7.self_attn.q_proj",
                                    "model.layers.0.mlp.experts.0.gate_proj"])
def test_module_the_base_does_not_have(llama, tmp_path, module):
    adapter = write_adapter(tmp_path / "a", lora_pair(module, 4, 64, 64))
    message = plan_error(llama, adapter)
    assert module in message and "no tensor" in message


def test_adapter_for_another_architecture(llama, tiny_checkpoints, tmp_path):
    import tests.families.test_mixtral  # noqa: F401

    other, _ = tiny_checkpoints("mixtral")
    pair = lora_pair(Q, 4, 64, 64)
    message = plan_error(llama, write_adapter(tmp_path / "path", pair, base_model_name_or_path=str(other)))
    assert "base_model_name_or_path" in message and "'mixtral'" in message and "another architecture" in message
    adapter = write_adapter(tmp_path / "class", pair, auto_mapping={"base_model_class": "MixtralForCausalLM"})
    assert "auto_mapping.base_model_class" in plan_error(llama, adapter)
    # ... and the same adapter on a base of its architecture is fine
    fine = write_adapter(tmp_path / "fine", pair, auto_mapping={"base_model_class": "LlamaForCausalLM"})
    otfload.plan_model(llama, adapter=fine)[2].close()


def test_replaced_module_of_the_wrong_shape_and_unknown_factors(llama, tmp_path):
    adapter = write_adapter(tmp_path / "a", {"lm_head.weight": np.zeros((255, 64), np.float32)},
                            modules_to_save=["lm_head"])
    assert "'lm_head.weight'" in plan_error(llama, adapter)
    dora = {**lora_pair(Q, 4, 64, 64), f"{Q}.lora_magnitude_vector": np.ones(64, np.float32)}
    assert "lora_magnitude_vector" in plan_error(llama, write_adapter(tmp_path / "b", dora))
    nested = {f"{Q}.base_layer.lora_A.weight": np.zeros((4, 64), np.float32),
              f"{Q}.base_layer.lora_B.weight": np.zeros((64, 4), np.float32)}
    assert "target_parameters" in plan_error(llama, write_adapter(tmp_path / "c", nested))


def test_module_the_family_does_not_map(llama, tmp_path):
    """A base tensor no leaf uses (allowed in the base) must not be adapted silently for nothing."""
    from safetensors.numpy import save_file

    base = tmp_path / "base"
    shutil.copytree(llama, base)
    save_file({"model.layers.0.mlp.extra_proj.weight": np.zeros((64, 64), np.float32)}, base / "extra.safetensors")
    index = json.loads((base / "model.safetensors.index.json").read_text())
    index["weight_map"]["model.layers.0.mlp.extra_proj.weight"] = "extra.safetensors"
    (base / "model.safetensors.index.json").write_text(json.dumps(index))
    otfload.plan_model(base)[2].close()
    adapter = write_adapter(tmp_path / "a", lora_pair("model.layers.0.mlp.extra_proj", 4, 64, 64))
    message = plan_error(base, adapter)
    assert "model.layers.0.mlp.extra_proj.weight" in message and "does not map" in message


def test_tied_pair_with_ensure_weight_tying_is_refused(tiny_checkpoints, tmp_path):
    tied, _ = tiny_checkpoints("llama_tied")
    embed = {"model.embed_tokens.lora_embedding_A": np.zeros((4, 256), np.float32),
             "model.embed_tokens.lora_embedding_B": np.zeros((64, 4), np.float32)}
    adapter = write_adapter(tmp_path / "a", embed, ensure_weight_tying=True)
    assert "ensure_weight_tying" in plan_error(tied, adapter)


def test_pickle_only_adapter_is_refused(llama, tmp_path):
    adapter = write_adapter(tmp_path / "a", lora_pair(Q, 4, 64, 64))
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    with pytest.raises(UnsafeFormatError):
        otfload.plan_model(llama, adapter=adapter)


@pytest.mark.parametrize("key", [Q, K, "model.layers.2.self_attn.o_proj", "model.layers.12.mlp.down_proj",
                                 "model.layers.1.mlp.experts.gate_up_proj", "lm_head"])
def test_rank_and_alpha_patterns_match_as_peft_matches_them(key):
    from peft.utils.other import get_pattern_key

    rank_pattern = {"q_proj": 8, r"layers\.1\..*": 2, r"layers\.1\.self_attn\.k_proj": 16, "experts.gate_up_proj": 6,
                    r"\d\.mlp\.down_proj": 3}
    alpha_pattern = {"o_proj": 3.5, r"model\.layers\.\d+\..*": 32, "head": 1}
    config = parse_adapter_config({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "rank_pattern": rank_pattern,
                                   "alpha_pattern": alpha_pattern}, "here")
    want_r = rank_pattern.get(get_pattern_key(rank_pattern.keys(), key), 4)
    want_alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), key), 8)
    assert config.rank_and_alpha(key) == (want_r, want_alpha)
