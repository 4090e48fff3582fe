"""Quantized checkpoints in every published layout load dequantised, shard by shard, with the
weights of the exact dequantised reference and the logits of transformers run on those weights.

Each layout is written from a tiny float checkpoint (tests/index/quant/layouts.py says who writes the
bytes and who computes the reference). Meshes split the matrices so that shard edges cut through
quantization blocks and groups (hidden 64 / tp 4 = 16 columns against groups of 32 and blocks of
48).
"""

import copy
import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch

import otfload
from otfload.errors import QuantizationError, UnfaithfulCastError
from otfload.plan.sharding import make_mesh
from tests.families.moe_helpers import MESHES
from tests.helpers import hf_tensors, jax_logits, max_rel_diff, token_ids, torch_logits
from tests.index.quant import layouts
from tests.quantized_fixtures import quantized_factory

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
GPTQ_INT4 = layouts.gptq_config(4, 32)
GPTQ_INT8_V2 = layouts.gptq_config(8, -1, sym=False, fmt="gptq_v2")
GPTQ_DESC_ACT = layouts.gptq_config(4, 32, desc_act=True, sym=False)

# name -> (tiny model kind, tensor selector, quantizer, quantization_config)
LAYOUTS = {
    "fp8_block_f32": ("llama", layouts.is_linear, layouts.fp8_blocks((48, 48)),
                      {**FP8_CONFIG, "weight_block_size": [48, 48]}),
    "fp8_block_bf16_scales": ("qwen3", layouts.is_linear, layouts.fp8_blocks((48, 48), scale_dtype=torch.bfloat16),
                              {**FP8_CONFIG, "weight_block_size": [48, 48]}),
    "fp8_tensor_null_block": ("mistral", layouts.is_linear, layouts.fp8_blocks(None),
                              {**FP8_CONFIG, "weight_block_size": None}),
    "fbgemm_fp8": ("llama", layouts.is_linear, layouts.fp8_blocks(None, "_scale", per_row=True),
                   {"quant_method": "fbgemm_fp8", "modules_to_not_convert": ["lm_head"]}),
    **{f"ct_{kind}": ("llama", layouts.is_linear, layouts.compressed_tensors(kind), layouts.ct_config(kind))
       for kind in ("fp8_tensor", "fp8_channel", "fp8_block", "w4a16", "w4a16_asym", "w8a16_channel", "nvfp4")},
    "ct_w4a16_moe_experts": ("qwen3_moe", lambda k: layouts.is_linear(k) and ".experts." in k,
                             layouts.compressed_tensors("w4a16"), layouts.ct_config("w4a16")),
    "ct_fp8_channel_moe": ("mixtral", layouts.is_linear, layouts.compressed_tensors("fp8_channel"),
                           layouts.ct_config("fp8_channel", ignore=["lm_head", "re:.*block_sparse_moe.gate$"])),
    "mxfp4_gpt_oss": ("gpt_oss", layouts.is_gpt_oss_expert, layouts.mxfp4_experts, layouts.MXFP4_CONFIG),
    "gptq_int4_sym": ("llama", layouts.is_linear, layouts.gptq(GPTQ_INT4), GPTQ_INT4),
    "gptq_int8_asym_v2_whole_rows": ("qwen3", layouts.is_linear, layouts.gptq(GPTQ_INT8_V2), GPTQ_INT8_V2),
    "gptq_int4_desc_act": ("llama", layouts.is_linear, layouts.gptq(GPTQ_DESC_ACT), GPTQ_DESC_ACT),
    "gptq_int4_moe_experts": ("qwen3_moe", lambda k: layouts.is_linear(k) and ".experts." in k,
                              layouts.gptq(GPTQ_INT4), GPTQ_INT4),
    "awq_gemm": ("llama", layouts.is_linear, layouts.awq, layouts.AWQ_CONFIG),
    "awq_moe_experts": ("mixtral", lambda k: layouts.is_linear(k) and ".experts." in k, layouts.awq,
                        layouts.AWQ_CONFIG),
    "modelopt_fp8": ("llama", layouts.is_linear, layouts.modelopt_fp8, layouts.MODELOPT_FP8_FILE),
    "modelopt_nvfp4": ("llama", layouts.is_linear, layouts.modelopt_nvfp4, layouts.MODELOPT_NVFP4_CONFIG),
    "modelopt_nvfp4_moe_experts": ("qwen3_moe", lambda k: layouts.is_linear(k) and ".experts." in k,
                                   layouts.modelopt_nvfp4, layouts.MODELOPT_NVFP4_CONFIG),
}


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory):
    """``quantized(layout) -> QuantizedCheckpoint(dir, float torch model, reference dequantised torch model,
    reference)``."""
    import tests.families.test_gpt_oss  # noqa: F401  (registers the MoE kinds)
    import tests.families.test_mixtral  # noqa: F401
    import tests.families.test_qwen3_moe  # noqa: F401

    return quantized_factory(tiny_checkpoints, tmp_path_factory, LAYOUTS)


def mesh_for(layout: str, mesh_2x4):
    return make_mesh(MESHES["fsdp2_ep4"]) if "moe" in layout or "gpt_oss" in layout else mesh_2x4


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_logits_match_transformers_on_the_dequantised_weights(quantized, layout, mesh_2x4):
    path, _, reference_model, _ = quantized(layout)
    model, report = otfload.from_pretrained(path, mesh=mesh_for(layout, mesh_2x4), dtype="float32",
                                            return_report=True)
    assert report.unused_tensors == []  # every scale, zero point and block was used
    ids = token_ids()
    # the session's jitted forward: the dequantised models of one base share one compiled program
    diff = max_rel_diff(jax_logits(model, ids), torch_logits(reference_model, ids))
    assert diff <= 1e-4, diff


@pytest.mark.parametrize("layout", ["fp8_block_f32", "ct_w4a16_asym", "ct_nvfp4", "ct_fp8_block", "fbgemm_fp8",
                                    "gptq_int4_sym", "gptq_int4_desc_act", "gptq_int8_asym_v2_whole_rows", "awq_gemm",
                                    "modelopt_fp8", "modelopt_nvfp4"])
@pytest.mark.parametrize("scan_layers", [True, False])
def test_each_shard_holds_the_reference_dequantised_values(quantized, layout, scan_layers, mesh_2x4):
    path, _, _, reference = quantized(layout)
    model = otfload.from_pretrained(path, mesh=mesh_2x4, dtype="float32", scan_layers=scan_layers)
    for layer in range(3):
        kernel = model.layers.mlp.down.kernel if scan_layers else model.layers[layer].mlp.down.kernel
        value = kernel[...]
        assert len(value.sharding.device_set) == 8
        got = np.asarray(value)[layer] if scan_layers else np.asarray(value)
        np.testing.assert_array_equal(got, reference[f"model.layers.{layer}.mlp.down_proj.weight"])


def test_mxfp4_experts_equal_transformers_dequantisation(quantized):
    path, _, _, reference = quantized("mxfp4_gpt_oss")
    model = otfload.from_pretrained(path, mesh=make_mesh(MESHES["fsdp2_ep4"]), dtype="float32", scan_layers=False)
    fused = reference["model.layers.1.mlp.experts.gate_up_proj"]
    moe = model.layers[1].moe
    np.testing.assert_array_equal(np.asarray(moe.gate.kernel[...]), fused[..., ::2])
    np.testing.assert_array_equal(np.asarray(moe.up.kernel[...]), fused[..., 1::2])
    np.testing.assert_array_equal(np.asarray(moe.down.kernel[...]), reference["model.layers.1.mlp.experts.down_proj"])


def test_quantized_checkpoints_default_to_bf16_and_stay_close_to_float(quantized):
    path, torch_model, _, _ = quantized("ct_fp8_channel")
    assert otfload.from_pretrained(path).layers.attn.q.kernel[...].dtype == jnp.bfloat16
    # e4m3 keeps 3 mantissa bits; over 3 layers of random weights the logits drift well under 15 %.
    f32 = otfload.from_pretrained(path, dtype="float32")
    ids = token_ids()
    assert max_rel_diff(np.asarray(f32(jnp.asarray(ids))), torch_logits(copy.deepcopy(torch_model), ids)) <= 0.15


def test_scales_are_never_dropped_even_without_strict(quantized, tmp_path):
    """compressed-tensors FP8 with its quantization_config stripped: raw codes must not load."""
    path, *_ = quantized("ct_fp8_channel")
    stripped = tmp_path / "stripped"
    shutil.copytree(path, stripped)
    config = json.loads((stripped / "config.json").read_text())
    del config["quantization_config"]
    (stripped / "config.json").write_text(json.dumps(config))
    with pytest.raises(QuantizationError, match="no known layout explains: '.*weight_scale'"):
        otfload.from_pretrained(stripped, strict=False)


def with_tensor(src, dst, key: str, value: np.ndarray):
    """Copy checkpoint ``src`` to ``dst`` with tensor ``key`` set to ``value`` (added to the first
    shard when new)."""
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst)
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = index["weight_map"].setdefault(key, sorted(index["weight_map"].values())[0])
    tensors = load_file(dst / shard)
    tensors[key] = value
    save_file(tensors, dst / shard, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))
    return dst


@pytest.mark.parametrize("stored", [np.int32, np.bool_, ml_dtypes.float8_e4m3fn])
def test_unfaithful_casts_are_typed_errors(tiny_checkpoints, tmp_path, stored):
    src, _ = tiny_checkpoints("llama")
    key = "model.layers.1.mlp.up_proj.weight"
    path = with_tensor(src, tmp_path / "ckpt", key, hf_tensors(src)[key].astype(stored))
    with pytest.raises(UnfaithfulCastError, match=f"{np.dtype(stored)} .* of {key!r}"):
        otfload.from_pretrained(path)


def test_activation_scales_go_to_the_report_not_the_weights(quantized, tmp_path):
    path, _, reference_model, _ = quantized("ct_fp8_tensor")
    key = "model.layers.0.self_attn.q_proj.input_scale"
    static = with_tensor(path, tmp_path / "static", key, np.array([0.25], np.float32))
    model, report = otfload.from_pretrained(static, dtype="float32", return_report=True)
    np.testing.assert_array_equal(report.activation_scales[key], [0.25])
    ids = token_ids()
    assert max_rel_diff(np.asarray(model(jnp.asarray(ids))), torch_logits(reference_model, ids)) <= 1e-4


def test_export_of_a_dequantised_model_drops_the_quantization_config(quantized, tmp_path, mesh_2x4):
    from otfload.export import export_hf

    path, _, _, reference = quantized("ct_w4a16")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, dtype="float32")
    out = export_hf(model, tmp_path / "out")
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    key = "model.layers.2.self_attn.o_proj.weight"
    np.testing.assert_array_equal(hf_tensors(out)[key], reference[key])


REALCONFIGS = Path(__file__).resolve().parents[2] / "shared" / "realconfigs"
NVIDIA_FP8 = REALCONFIGS / "nvidia__Llama-3.1-70B-Instruct-FP8.json"


def without_tensors(src, dst, drop) -> None:
    """Copy checkpoint ``src`` to ``dst`` without the tensors whose key ``drop`` picks."""
    from safetensors.torch import load_file, save_file  # numpy has no float8

    shutil.copytree(src, dst)
    index_file = dst / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    for shard in sorted(dst.glob("*.safetensors")):
        save_file({k: v for k, v in load_file(shard).items() if not drop(k)}, shard, metadata={"format": "pt"})
    index["weight_map"] = {k: f for k, f in index["weight_map"].items() if not drop(k)}
    index_file.write_text(json.dumps(index))


@pytest.mark.skipif(not NVIDIA_FP8.is_file(), reason="../shared/realconfigs is not checked out")
def test_nvidia_fp8_release_loads_by_its_hf_quant_config_and_is_a_typed_error_without(quantized, tmp_path):
    """nvidia/Llama-3.1-70B-Instruct-FP8's config.json names no quantization: hf_quant_config.json
    beside it does. With it the FP8 weights load exactly; without it, or without their scales, never."""
    real = json.loads(NVIDIA_FP8.read_text())
    assert "quantization_config" not in real
    path, _, reference_model, _ = quantized("modelopt_fp8")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(path, ckpt)
    config = {k: v for k, v in real.items() if k not in ("rope_scaling", "rope_theta")}
    config.update(json.loads((path / "config.json").read_text()))  # the tiny model's sizes
    assert "quantization_config" not in config
    (ckpt / "config.json").write_text(json.dumps(config))
    model, report = otfload.from_pretrained(ckpt, dtype="float32", return_report=True)
    assert report.activation_scales["model.layers.0.self_attn.q_proj.input_scale"] == 0.5
    ids = token_ids()
    assert max_rel_diff(np.asarray(model(jnp.asarray(ids))), torch_logits(reference_model, ids)) <= 1e-4
    (ckpt / "hf_quant_config.json").unlink()
    with pytest.raises(QuantizationError, match="weight_scale.*hf_quant_config.json"):
        otfload.from_pretrained(ckpt, strict=False)
    without_tensors(ckpt, tmp_path / "bare", lambda k: k.endswith("_scale"))  # FP8 codes alone
    with pytest.raises(UnfaithfulCastError, match="float8_e4m3fn"):
        otfload.from_pretrained(tmp_path / "bare", strict=False)
