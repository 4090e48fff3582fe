"""Hostile and inconsistent ``config.json`` files on real tiny checkpoints of every family: each is a
typed :class:`ConfigError` naming the field, raised before anything is built or planned (well under a
second), never a KeyError/TypeError/ValueError/ZeroDivisionError or a plan that does not end."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

import otfload
from otfload.config import Fields, Float, Int
from otfload.errors import CheckpointIndexError, ConfigError, MissingTensorError
from otfload.families.registry import family_for
from tests import forked
from tests.config.support import DELETE, copy_checkpoint, drop_tensors, with_config, write_config
from tests.helpers import hf_tensors

# Validation reads config.json and headers only: a second of this process's CPU time is generous
# (CPU, not wall time: a loaded test machine stretches the wall clock, not the work done).
FAST_S = 1.0
DEEP = [[[[[[[[[[[]]]]]]]]]]]

# id: (tiny checkpoint kind, changes to its config.json, the field the ConfigError must name)
HOSTILE: dict[str, tuple[str, dict, str]] = {
    "layers-1e9-float": ("llama", {"num_hidden_layers": 1e9}, "num_hidden_layers"),
    "layers-10**9": ("llama", {"num_hidden_layers": 10**9}, "num_hidden_layers"),
    "layers-10**6": ("llama", {"num_hidden_layers": 10**6}, "num_hidden_layers"),
    "layers-10**400": ("llama", {"num_hidden_layers": 10**400}, "num_hidden_layers"),
    "layers-negative": ("llama", {"num_hidden_layers": -3}, "num_hidden_layers"),
    "layers-zero": ("llama", {"num_hidden_layers": 0}, "num_hidden_layers"),
    "layers-bool": ("llama", {"num_hidden_layers": True}, "num_hidden_layers"),
    "layers-float-3.0": ("llama", {"num_hidden_layers": 3.0}, "num_hidden_layers"),
    "layers-string": ("llama", {"num_hidden_layers": "3"}, "num_hidden_layers"),
    "layers-list": ("llama", {"num_hidden_layers": [3]}, "num_hidden_layers"),
    "layers-more-than-tensors": ("llama", {"num_hidden_layers": 4}, "num_hidden_layers"),
    "layers-1000-vs-3-tensors": ("llama", {"num_hidden_layers": 1000}, "num_hidden_layers"),
    "layers-fewer-than-tensors": ("llama", {"num_hidden_layers": 2}, "num_hidden_layers"),
    "layers-missing": ("llama", {"num_hidden_layers": DELETE}, "num_hidden_layers"),
    "layers-null": ("llama", {"num_hidden_layers": None}, "num_hidden_layers"),
    "tie-string-no": ("llama", {"tie_word_embeddings": "no"}, "tie_word_embeddings"),
    "tie-int-0": ("llama", {"tie_word_embeddings": 0}, "tie_word_embeddings"),
    "attention-bias-string": ("llama", {"attention_bias": "false"}, "attention_bias"),
    "hidden-act-unknown": ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    "hidden-act-not-string": ("llama", {"hidden_act": {"name": "silu"}}, "hidden_act"),
    "rope-type-unknown": ("llama", {"rope_parameters.rope_type": "dynamic"}, "rope_parameters.rope_type"),
    "rope-scaling-type-unknown": ("qwen2", {"rope_scaling": {"type": "longrope", "factor": 2.0}},
                                  "rope_scaling.type"),
    "rope-scaling-not-object": ("llama", {"rope_scaling": "yarn"}, "rope_scaling"),
    "rope-parameters-deep-list": ("llama", {"rope_parameters": DEEP}, "rope_parameters"),
    "rope-llama3-missing-factor": ("llama", {"rope_parameters.factor": DELETE}, "rope_parameters.factor"),
    "rope-llama3-high-not-above-low": ("llama", {"rope_parameters.high_freq_factor": 0.5},
                                       "rope_parameters.high_freq_factor"),
    "rope-theta-nan": ("llama", {"rope_parameters.rope_theta": float("nan")}, "rope_parameters.rope_theta"),
    "rope-theta-infinity": ("mistral", {"rope_parameters.rope_theta": float("inf")}, "rope_parameters.rope_theta"),
    "rope-theta-one": ("mistral", {"rope_parameters.rope_theta": 1}, "rope_parameters.rope_theta"),
    "rope-yarn-string-factor": ("gpt_oss", {"rope_parameters.factor": "32"}, "rope_parameters.factor"),
    "heads-not-dividing-hidden": ("llama", {"num_attention_heads": 3, "num_key_value_heads": 1, "head_dim": None},
                                  "hidden_size"),
    "kv-heads-not-dividing-heads": ("llama", {"num_key_value_heads": 3}, "num_key_value_heads"),
    "kv-heads-zero": ("llama", {"num_key_value_heads": 0}, "num_key_value_heads"),
    "heads-vs-q-proj": ("llama", {"num_attention_heads": 8}, "num_attention_heads"),
    "kv-heads-vs-k-proj": ("llama", {"num_key_value_heads": 4}, "num_key_value_heads"),
    "hidden-vs-embed": ("llama", {"hidden_size": 128}, "hidden_size"),
    "vocab-vs-embed": ("llama", {"vocab_size": 512}, "vocab_size"),
    "vocab-huge": ("llama", {"vocab_size": 2**40}, "vocab_size"),
    "head-dim-odd": ("llama", {"head_dim": 15}, "head_dim"),
    "intermediate-huge": ("llama", {"intermediate_size": 10**12}, "intermediate_size"),
    "vocab-missing": ("llama", {"vocab_size": DELETE}, "vocab_size"),
    "eps-negative": ("llama", {"rms_norm_eps": -1e-6}, "rms_norm_eps"),
    "model-type-int": ("llama", {"model_type": 7}, "model_type"),
    "model-type-list": ("llama", {"model_type": ["llama"]}, "model_type"),
    "model-type-missing": ("llama", {"model_type": DELETE}, "model_type"),
    "sliding-window-negative": ("mistral", {"sliding_window": -1}, "sliding_window"),
    "use-sliding-window-string": ("qwen2", {"use_sliding_window": "yes"}, "use_sliding_window"),
    "experts-more-than-tensors": ("mixtral", {"num_local_experts": 8}, "num_local_experts"),
    "experts-fewer-than-tensors": ("mixtral", {"num_local_experts": 3}, "num_local_experts"),
    "experts-10**9": ("mixtral", {"num_local_experts": 10**9}, "num_local_experts"),
    "top-k-above-experts": ("mixtral", {"num_experts_per_tok": 5}, "num_experts_per_tok"),
    "top-k-zero": ("mixtral", {"num_experts_per_tok": 0}, "num_experts_per_tok"),
    "qwen3-moe-experts-vs-tensors": ("qwen3_moe", {"num_local_experts": 6}, "num_local_experts"),
    "qwen3-moe-sparse-step-zero": ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step"),
    "qwen3-moe-mlp-only-not-list": ("qwen3_moe", {"mlp_only_layers": 1}, "mlp_only_layers"),
    "qwen3-moe-mlp-only-bad-item": ("qwen3_moe", {"mlp_only_layers": [1, "2"]}, "mlp_only_layers[1]"),
    "gpt-oss-experts-vs-fused": ("gpt_oss", {"num_local_experts": 2}, "num_local_experts"),
    "gpt-oss-layer-types-length": ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types"),
    "gpt-oss-layer-type-unknown": ("gpt_oss", {"layer_types": ["chunked_attention"] * 3}, "layer_types[0]"),
    "gpt-oss-swiglu-limit-zero": ("gpt_oss", {"swiglu_limit": 0}, "swiglu_limit"),
    "deepseek-layers-vs-tensors": ("deepseek_v3", {"num_hidden_layers": 5}, "num_hidden_layers"),
    "deepseek-experts-vs-tensors": ("deepseek_v3", {"n_routed_experts": 8}, "n_routed_experts"),
    "deepseek-groups-not-dividing": ("deepseek_v3", {"n_group": 3}, "n_group"),
    "deepseek-topk-group-above-groups": ("deepseek_v3", {"topk_group": 3}, "topk_group"),
    "deepseek-moe-layer-freq": ("deepseek_v3", {"moe_layer_freq": 2}, "moe_layer_freq"),
    "deepseek-first-dense-negative": ("deepseek_v3", {"first_k_dense_replace": -1}, "first_k_dense_replace"),
    "deepseek-q-lora-string": ("deepseek_v3", {"q_lora_rank": "24"}, "q_lora_rank"),
    "deepseek-heads-vs-o-proj": ("deepseek_v3", {"num_attention_heads": 2}, "num_attention_heads"),
    "deepseek-v2-topk-method": ("deepseek_v2", {"topk_method": "noaux_tc"}, "topk_method"),
    "deepseek-hidden-act": ("deepseek_v2", {"hidden_act": "relu"}, "hidden_act"),
    "gemma-activation-unknown": ("gemma3_text", {"hidden_activation": "relu"}, "hidden_activation"),
    "gemma-rope-per-type-unknown": ("gemma3_text", {"rope_parameters.full_attention.rope_type": "dynamic"},
                                    "rope_parameters.full_attention.rope_type"),
    "gemma-layer-types-length": ("gemma2", {"layer_types": ["full_attention"] * 5}, "layer_types"),
    "gemma-pre-attn-scalar-zero": ("gemma2", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    "gemma-softcap-string": ("gemma2", {"final_logit_softcapping": "30"}, "final_logit_softcapping"),
    "gemma3-text-config-not-object": ("gemma3_multimodal", {"text_config": "gemma"}, "text_config"),
    "gemma3-text-config-missing": ("gemma3_multimodal", {"text_config": DELETE}, "text_config"),
    "gemma3-text-layers-1e9": ("gemma3_multimodal", {"text_config.num_hidden_layers": 1e9},
                               "text_config.num_hidden_layers"),
    "gemma3-text-layers-vs-tensors": ("gemma3_multimodal", {"text_config.num_hidden_layers": 5,
                                                             "text_config.layer_types": DELETE},
                                      "text_config.num_hidden_layers"),
    "gemma3-text-hidden-vs-embed": ("gemma3_multimodal", {"text_config.hidden_size": 32}, "text_config.hidden_size"),
    "gemma3-tie-string": ("gemma3_multimodal", {"tie_word_embeddings": "true"}, "tie_word_embeddings"),
}


def config_error(path, **kwargs) -> tuple[ConfigError, float]:
    """The ConfigError loading ``path`` raises, and the seconds it took."""
    start = time.process_time()
    with pytest.raises(ConfigError) as caught:
        otfload.from_pretrained(path, **kwargs)
    return caught.value, time.process_time() - start


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_hostile_config_is_a_config_error_naming_the_field(tiny_checkpoints, tmp_path, case):
    kind, changes, field = HOSTILE[case]
    path = with_config(tiny_checkpoints, tmp_path / "ckpt", kind, changes)
    error, seconds = config_error(path)
    assert type(error) is ConfigError
    assert error.field == field and f"{field} = " in str(error), str(error)
    assert error.rule and error.rule in str(error)
    assert seconds < FAST_S, seconds


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2", "mixtral", "qwen3_moe", "gpt_oss", "deepseek_v2",
                                  "deepseek_v3", "gemma2", "gemma3_text", "gemma3_multimodal"])
def test_every_base_config_plans(tiny_checkpoints, kind):
    """The hostile cases fail because of their change: each unchanged config plans."""
    path, _ = tiny_checkpoints(kind)
    _, plan, src = otfload.plan_model(path)
    src.close()
    assert plan.leaves


# Values transformers accepts and otfload reads the same way: they must keep loading.
BENIGN = {
    "hidden-act-swish": ("llama", {"hidden_act": "swish"}),
    "head-dim-null-derived": ("llama", {"head_dim": None}),  # 64 / 4 heads = 16, as stored
    "rope-scaling-empty": ("llama", {"rope_scaling": {}}),
    "rope-type-legacy-key": ("mistral", {"rope_parameters": DELETE, "rope_theta": 10000,
                                         "rope_scaling": {"type": "linear", "factor": 2}}),
    "eps-integer": ("llama", {"rms_norm_eps": 1}),
    "tie-null-is-default": ("llama", {"tie_word_embeddings": None}),
    "unread-fields-untouched": ("llama", {"initializer_range": "anything", "pretraining_tp": [1]}),
}


@pytest.mark.parametrize("case", sorted(BENIGN))
def test_benign_configs_still_load(tiny_checkpoints, tmp_path, case):
    kind, changes = BENIGN[case]
    path = with_config(tiny_checkpoints, tmp_path / "ckpt", kind, changes)
    model = otfload.from_pretrained(path)
    hf = hf_tensors(path)
    np.testing.assert_array_equal(np.asarray(model.embed.embedding[...]), hf["model.embed_tokens.weight"])


def test_config_that_is_a_json_array_is_a_typed_error(tiny_checkpoints, tmp_path):
    path = copy_checkpoint(tiny_checkpoints, tmp_path / "ckpt", "llama")
    write_config(path, [{"model_type": "llama"}])
    with pytest.raises(CheckpointIndexError, match="not a JSON object"):
        otfload.from_pretrained(path)


@pytest.mark.parametrize("model_type", [None, 3, 2.5, True, ["llama"], {"name": "llama"}])
def test_family_of_a_non_string_model_type_is_a_config_error(model_type):
    with pytest.raises(ConfigError) as caught:
        family_for({"model_type": model_type})
    assert caught.value.field == "model_type"


def test_family_of_a_config_that_is_not_an_object_is_a_config_error():
    with pytest.raises(ConfigError) as caught:
        family_for(["llama"])
    assert caught.value.field == "config"


def test_unknown_model_type_is_still_named_as_unsupported():
    from otfload.errors import UnsupportedModelError

    with pytest.raises(UnsupportedModelError, match="made_up_lm") as caught:
        family_for({"model_type": "made_up_lm"})
    assert not isinstance(caught.value, ConfigError)


SPEC_CASES = [
    (Int(1, 8), True), (Int(1, 8), 3.0), (Int(1, 8), 9), (Int(1, 8), "3"), (Int(1, 8), 10**5000),
    (Float(0, 1), float("nan")), (Float(0, 1), float("inf")), (Float(0, 1), 10**400), (Float(0, 1), False),
    (Float(0, 1, exclusive_min=True), 0),
]


@pytest.mark.parametrize(("spec", "value"), SPEC_CASES, ids=[str(i) for i in range(len(SPEC_CASES))])
def test_specs_reject_wrong_types_and_ranges_with_config_errors(spec, value):
    with pytest.raises(ConfigError) as caught:
        Fields({"x": value}).get("x", spec)
    assert caught.value.field == "x" and "x = " in str(caught.value)


def test_specs_accept_in_range_values():
    f = Fields({"i": 8, "f": 1, "g": 0.5})
    assert (f.get("i", Int(1, 8)), f.get("f", Float(0, 1)), f.get("g", Float(0, 1))) == (8, 1.0, 0.5)
    assert f.get("absent", Int(1, 8), 3) == 3


def test_a_stack_of_more_tensors_than_any_checkpoint_holds_fails_before_enumerating(tiny_checkpoints, mesh_2x4):
    """Defence in depth for trees the config does not bound (``load_params``): the planner refuses a
    leaf stacking more than MAX_STACK_SLICES tensors instead of formatting a key for each."""
    import jax

    from otfload.errors import MappingError
    from otfload.plan.mapping import MAX_STACK_SLICES

    path, _ = tiny_checkpoints("llama")
    abstract = {"layers": {"norm": jax.ShapeDtypeStruct((MAX_STACK_SLICES * 1000, 64), np.float32)}}
    start = time.process_time()
    with pytest.raises(MappingError, match=str(MAX_STACK_SLICES)):
        otfload.load_params(path, abstract, {"layers.norm": "model.layers.{layer}.input_layernorm.weight"},
                            mesh=mesh_2x4)
    assert time.process_time() - start < FAST_S


# --- item 7: an untied config needs lm_head.weight ---------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mixtral", "deepseek_v2", "gemma2_untied_bias"])
def test_untied_checkpoint_without_lm_head_is_a_missing_tensor(tiny_checkpoints, tmp_path, kind):
    path = copy_checkpoint(tiny_checkpoints, tmp_path / "ckpt", kind)
    assert json.loads((path / "config.json").read_text())["tie_word_embeddings"] is False
    drop_tensors(path, ["lm_head.weight", "model.norm.weight"])
    with pytest.raises(MissingTensorError) as caught:
        otfload.from_pretrained(path)
    missing = {(p.hf_key, p.leaf) for p in caught.value.missing}
    assert missing == {("lm_head.weight", "lm_head.kernel"), ("model.norm.weight", "final_norm.scale")}
    assert "lm_head.weight" in str(caught.value)


@pytest.mark.parametrize(("kind", "loads"), [("llama_tied", False), ("qwen2_tied", False), ("gemma3_text", True)])
def test_absent_tie_flag_takes_the_family_default(tiny_checkpoints, tmp_path, kind, loads):
    """transformers' default is untied for Llama and Qwen2 (lm_head.weight required), tied for Gemma."""
    path = with_config(tiny_checkpoints, tmp_path / "ckpt", kind, {"tie_word_embeddings": DELETE})
    hf = hf_tensors(path)
    assert "lm_head.weight" not in hf
    if loads:
        assert not hasattr(otfload.from_pretrained(path), "lm_head")
    else:
        with pytest.raises(MissingTensorError, match="lm_head.weight"):
            otfload.from_pretrained(path)


def test_tied_checkpoint_loads_without_lm_head(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama_tied")
    model = otfload.from_pretrained(path)
    assert not hasattr(model, "lm_head")


# --- the command line --------------------------------------------------------------------------------


def run_inspect(path) -> subprocess.CompletedProcess:
    """``python -m otfload.cli inspect PATH`` in a fresh process forked from tests.forked's server."""
    return forked.run([sys.executable, "-m", "otfload.cli", "inspect", str(path)], timeout=120)


def test_inspect_exits_non_zero_with_the_config_error(tiny_checkpoints, tmp_path):
    bad = with_config(tiny_checkpoints, tmp_path / "bad", "llama", {"num_hidden_layers": 1e9})
    result = run_inspect(bad)
    assert result.returncode == 1, result.stdout
    assert "ConfigError" in result.stderr and "num_hidden_layers = 1000000000.0" in result.stderr
    assert "Traceback" not in result.stderr and result.stdout == ""
    good = run_inspect(tiny_checkpoints("llama")[0])
    assert good.returncode == 0 and "layers.attn.q.kernel" in good.stdout
