"""Layout detection: every quantized checkpoint is either decoded or a typed error naming the method
and the tensor — never raw codes loaded as weights, whatever ``strict`` says."""

import contextlib
import json

import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from otfload.errors import ConfigError, QuantizationError, UnsupportedQuantizationError
from otfload.index.checkpoint import open_index
from otfload.index.quant import QuantizedTensor
from otfload.sources import open_source

F8 = ml_dtypes.float8_e4m3fn


def checkpoint(tmp_path, tensors: dict, quantization_config=None, **config):
    save_file(tensors, tmp_path / "model.safetensors")
    cfg = {"model_type": "llama", **config}
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with contextlib.closing(open_source(tmp_path)) as source:  # the index is headers and config only
        return open_index(source)


def w8(shape=(64, 96)):
    return np.random.default_rng(0).standard_normal(shape).astype(F8)


def test_fp8_block_pairs_weight_and_scale(tmp_path):
    index = checkpoint(tmp_path, {"a.weight": w8(), "a.weight_scale_inv": np.ones((1, 1), np.float32)},
                       {"quant_method": "fp8", "weight_block_size": [128, 128]})
    q = index["a.weight"]
    assert isinstance(q, QuantizedTensor) and q.shape == (64, 96) and "a.weight_scale_inv" not in index
    assert q.nbytes == 64 * 96 + 4


def test_fp8_null_block_takes_a_scalar_scale(tmp_path):
    index = checkpoint(tmp_path, {"a.weight": w8(), "a.weight_scale_inv": np.array(0.5, np.float32)},
                       {"quant_method": "fp8", "weight_block_size": None})
    assert index["a.weight"].scales.block == (64, 96)


@pytest.mark.parametrize(("tensors", "qc", "match"), [
    ({"a.weight": w8(), "a.weight_scale_inv": np.ones((2, 2), np.float32)},
     {"quant_method": "fp8", "weight_block_size": [128, 128]}, "needs \\[1, 1\\]"),
    ({"a.weight": w8(), "a.weight_scale_inv": np.ones((3, 5), np.float32)},
     {"quant_method": "fp8", "weight_block_size": None}, "neither per tensor nor per row"),
    ({"a.weight": np.zeros((4, 4), np.float32), "a.weight_scale_inv": np.ones((1, 1), np.float32)},
     {"quant_method": "fp8"}, "expected an FP8 weight"),
    ({"a.weight": w8()}, {"quant_method": "fp8"}, "have no scale"),
    ({"a.weight": w8(), "a.weight_scale": np.ones((64, 1), np.float32)}, None,
     "no quantization_config.*no known layout explains: 'a.weight_scale'"),
    ({"a.weight": w8(), "a.weight_scale": np.ones((64, 1), np.float32)}, {"quant_method": "fp8"},
     "fp8: 1 FP8 tensor\\(s\\) have no scale, e.g. 'a.weight'"),
    ({"a.weight": np.zeros((4, 4), np.float32), "a.weight_zero_point": np.ones((4, 1), np.int8)}, None,
     "no known layout explains: 'a.weight_zero_point'"),
    ({"a.weight_blocks": np.zeros((2, 4, 2, 16), np.uint8)}, {"quant_method": "mxfp4"}, "has no"),
    ({"a.weight_blocks": np.zeros((2, 4, 2, 8), np.uint8), "a.weight_scales": np.zeros((2, 4, 2), np.uint8)},
     {"quant_method": "mxfp4"}, "are not U8"),
    ({"a.weight": w8(), "a.weight_scale": np.ones((64, 1), np.float32)},
     {"quant_method": "compressed-tensors", "config_groups": {}}, "no config group targets it"),
    ({"a.weight": w8(), "a.weight_scale": np.ones((64, 1), np.float32)},
     {"quant_method": "compressed-tensors", "ignore": ["a"],
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}}, "'ignore'"),
    ({"a.weight": w8(), "a.weight_scale": np.ones((64, 1), np.float32)},
     {"quant_method": "compressed-tensors",
      "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 8, "strategy": "tensor"}}}},
     "needs \\[1, 1\\]"),
    ({"a.weight": np.zeros((4, 4), np.int8), "a.weight_scale": np.ones((4, 1), np.float32)},
     {"quant_method": "compressed-tensors", "config_groups": {"g": {"targets": ["Linear"], "weights": {
         "num_bits": 8, "strategy": "channel", "symmetric": False}}}}, "asymmetric but has no weight_zero_point"),
    ({"a.weight": np.zeros((4, 4), np.float32)}, {"quant_method": "turbo-q"}, "unknown quantization method"),
])
def test_what_no_layout_explains_is_a_quantization_error(tmp_path, tensors, qc, match):
    with pytest.raises(QuantizationError, match=match):
        checkpoint(tmp_path, tensors, qc)


@pytest.mark.parametrize("method", ["bitsandbytes", "BitsAndBytes", "hqq", "aqlm"])
def test_known_but_unsupported_methods_say_not_supported_yet(tmp_path, method):
    with pytest.raises(UnsupportedQuantizationError, match=f"{method.lower()!r} is not supported yet"):
        checkpoint(tmp_path, {"a.weight": np.zeros((4, 4), np.float32)}, {"quant_method": method})


@pytest.mark.parametrize(("qc", "field"), [
    ("fp8", "quantization_config"),
    (7, "quantization_config"),
    ({"quant_method": 3}, "quantization_config.quant_method"),
    ({"quant_method": "fp8", "weight_block_size": 128}, "quantization_config.weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "quantization_config.weight_block_size"),
    ({"quant_method": "fp8", "weight_block_size": [True, 128]}, "quantization_config.weight_block_size"),
    ({"quant_method": "compressed-tensors", "config_groups": []}, "quantization_config.config_groups"),
    ({"quant_method": "compressed-tensors", "ignore": "lm_head"}, "quantization_config.ignore"),
    ({"quant_method": "compressed-tensors", "config_groups": {"g": {"weights": {"num_bits": 16}}}},
     "quantization_config.config_groups.g.weights.num_bits"),
])
def test_wrong_typed_quantization_config_is_a_config_error(tmp_path, qc, field):
    with pytest.raises(ConfigError) as e:
        checkpoint(tmp_path, {"a.weight": w8(), "a.weight_scale_inv": np.ones((1, 1), np.float32)}, qc)
    assert e.value.field == field


def test_activation_scales_are_set_aside_not_weights(tmp_path):
    index = checkpoint(tmp_path, {"a.weight": w8(), "a.weight_scale": np.ones((1,), np.float32),
                                  "a.input_scale": np.ones((1,), np.float32), "attn.k_scale": np.ones((), np.float32)},
                       {"quant_method": "compressed-tensors", "config_groups": {"g": {
                           "targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}})
    assert set(index.activation) == {"a.input_scale", "attn.k_scale"}
    assert set(index.tensors) == {"a.weight"}


MODELOPT_FP8 = {"quant_method": "modelopt", "quant_algo": "FP8", "exclude_modules": ["lm_head"]}
NVFP4 = {"a.weight": np.zeros((4, 8), np.uint8), "a.weight_scale": np.ones((4, 1), F8),
         "a.weight_scale_2": np.ones((), np.float32)}


@pytest.mark.parametrize(("tensors", "qc", "match"), [
    ({"lm_head.weight": w8(), "lm_head.weight_scale": np.ones((), np.float32)}, MODELOPT_FP8,
     "'lm_head' has quantization scales but is listed in 'exclude_modules'"),
    ({"a.weight": w8(), "a.weight_scale": np.ones((3,), np.float32)}, MODELOPT_FP8, "neither per tensor nor per row"),
    ({"a.weight": w8()}, MODELOPT_FP8, "have no scale"),
    ({k: v for k, v in NVFP4.items() if k != "a.weight_scale_2"}, {**MODELOPT_FP8, "quant_algo": "NVFP4"},
     "needs a U8 'weight'.*'weight_scale_2'"),
    ({**NVFP4, "a.weight_scale_2": np.ones((2,), np.float32)}, {**MODELOPT_FP8, "quant_algo": "NVFP4"},
     "expected one value"),
    (NVFP4, {**MODELOPT_FP8, "quant_algo": "NVFP4", "group_size": 32}, "group_size 32, expected 16"),
    (NVFP4, MODELOPT_FP8, "has dtype uint8 \\(expected an FP8 weight\\)"),  # NVFP4 codes under an FP8 config
])
def test_modelopt_what_no_layout_explains_is_a_quantization_error(tmp_path, tensors, qc, match):
    with pytest.raises(QuantizationError, match=match):
        checkpoint(tmp_path, tensors, qc)


@pytest.mark.parametrize("algo", ["W4A8_AWQ", "INT4_AWQ", "MIXED_PRECISION"])
def test_modelopt_algorithms_not_decoded_say_so(tmp_path, algo):
    with pytest.raises(UnsupportedQuantizationError, match=f"quant_algo '{algo}' is not supported yet"):
        checkpoint(tmp_path, {"a.weight": w8(), "a.weight_scale": np.ones((), np.float32)},
                   {**MODELOPT_FP8, "quant_algo": algo})


def test_hf_quant_config_json_describes_a_modelopt_export(tmp_path):
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "exclude_modules": ["lm_head"]}}))
    index = checkpoint(tmp_path, {**NVFP4, "a.input_scale": np.ones((), np.float32)})
    q = index["a.weight"]
    assert isinstance(q, QuantizedTensor) and q.shape == (4, 16) and index.quant_method == "modelopt"
    assert q.scales.global_multiplies and set(index.activation) == {"a.input_scale"}


@pytest.mark.parametrize(("qc", "field"), [
    ({"quant_method": "modelopt", "quant_algo": 8}, "quantization_config.quant_algo"),
    ({"quant_method": "modelopt", "quantization": {"quant_algo": "FP8", "exclude_modules": "lm_head"}},
     "quantization_config.quantization.exclude_modules"),
    ({"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": "16"}, "quantization_config.group_size"),
])
def test_wrong_typed_modelopt_config_is_a_config_error(tmp_path, qc, field):
    with pytest.raises(ConfigError) as e:
        checkpoint(tmp_path, {"a.weight": w8(), "a.weight_scale": np.ones((), np.float32)}, qc)
    assert e.value.field == field


def test_quantization_config_nested_in_text_config_is_honoured(tmp_path):
    save_file({"a.weight": w8(), "a.weight_scale_inv": np.ones((1, 1), np.float32)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {
        "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}}))
    with contextlib.closing(open_source(tmp_path)) as source:
        index = open_index(source)
    assert index.quant_method == "fp8" and isinstance(index["a.weight"], QuantizedTensor)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": {
        "quantization_config": {"quant_method": 7}}}))
    with contextlib.closing(open_source(tmp_path)) as source, pytest.raises(ConfigError) as e:
        open_index(source)
    assert e.value.field == "text_config.quantization_config.quant_method"


def int_module(rows=64, cols=64, bits=4, groups=2, gptq=True):
    """The stored tensors of one GPTQ (``[in·b/32, out]``) or AWQ (``[in, out/8]``) module ``a``."""
    per = 32 // bits
    qweight = np.zeros((cols // per, rows) if gptq else (cols, rows // per), np.int32)
    return {"a.qweight": qweight, "a.qzeros": np.zeros((groups, rows // per), np.int32),
            "a.scales": np.ones((groups, rows), np.float16), "a.g_idx": np.zeros(cols, np.int32)}


GPTQ = {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True}
AWQ = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm"}


def test_gptq_and_awq_modules_become_one_weight_of_the_float_shape(tmp_path):
    index = checkpoint(tmp_path, {**int_module(rows=96), "b.weight": np.zeros((4, 4), np.float16)}, GPTQ)
    q = index["a.weight"]
    assert isinstance(q, QuantizedTensor) and q.shape == (96, 64) and q.transposed
    assert set(index.tensors) == {"a.weight", "b.weight"}  # g_idx of desc_act false is i // 32: never read
    awq = {k: v for k, v in int_module(rows=96, gptq=False).items() if k != "a.g_idx"}
    assert checkpoint(tmp_path, awq, AWQ)["a.weight"].shape == (96, 64)


@pytest.mark.parametrize(("tensors", "qc", "match"), [
    ({k: v for k, v in int_module().items() if k != "a.qzeros"}, GPTQ, "has a qweight but no qzeros"),
    ({**int_module(), "a.scales": np.ones((3, 64), np.float16)}, GPTQ,
     "'a.scales' has shape \\[3, 64\\], expected \\[2, 64\\]"),
    ({**int_module(), "a.qweight": np.zeros((8, 64), np.float32)}, GPTQ, "expected I32"),
    ({**int_module(), "a.weight": np.zeros((64, 64), np.float16)}, GPTQ, "both 'weight' and 'qweight'"),
    ({k: v for k, v in int_module().items() if k != "a.g_idx"}, {**GPTQ, "desc_act": True}, "no g_idx"),
    (int_module(gptq=False), AWQ, "AWQ has no g_idx"),
    ({"a.qzeros": np.zeros((2, 8), np.int32)}, GPTQ, "no known layout explains: 'a.qzeros'"),
])
def test_gptq_awq_what_no_layout_explains_is_a_quantization_error(tmp_path, tensors, qc, match):
    with pytest.raises(QuantizationError, match=match):
        checkpoint(tmp_path, tensors, qc)


@pytest.mark.parametrize(("qc", "match"), [
    ({**GPTQ, "bits": 3}, "3-bit codes are not supported yet"),
    ({**GPTQ, "checkpoint_format": "marlin"}, "checkpoint format 'marlin' is not supported yet"),
    ({**GPTQ, "is_marlin_format": True}, "\\(marlin\\) is not supported yet"),
    ({**GPTQ, "checkpoint_format": "gptq_p"}, "checkpoint format 'gptq_p' is not supported yet"),
    ({**GPTQ, "dynamic": {"re:.*down_proj": {"bits": 8}}}, "per-module overrides"),
    ({**AWQ, "version": "gemv"}, "version = 'gemv' is not supported yet"),
    ({**AWQ, "zero_point": False}, "only AWQ with zero points"),
    ({**AWQ, "bits": 8}, "only 4-bit AWQ"),
])
def test_gptq_awq_variants_not_decoded_say_so(tmp_path, qc, match):
    with pytest.raises(UnsupportedQuantizationError, match=match):
        checkpoint(tmp_path, int_module(), qc)


@pytest.mark.parametrize(("qc", "field"), [
    ({**GPTQ, "group_size": 0}, "quantization_config.group_size"),
    ({"quant_method": "awq", "w_bit": 4, "q_group_size": "128"}, "quantization_config.q_group_size"),
    ({**GPTQ, "desc_act": "no"}, "quantization_config.desc_act"),
    ({**GPTQ, "bits": 4.0}, "quantization_config.bits"),
    ({**GPTQ, "checkpoint_format": 2}, "quantization_config.checkpoint_format"),
])
def test_wrong_typed_gptq_awq_config_is_a_config_error(tmp_path, qc, field):
    with pytest.raises(ConfigError) as e:
        checkpoint(tmp_path, int_module(), qc)
    assert e.value.field == field
