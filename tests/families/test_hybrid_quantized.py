"""The published quantized layouts of the hybrids (Qwen3.5 / Qwen3.6, Nemotron-3) through the existing
quantized paths: tiny transformers checkpoints quantized here as the releases store them, loaded
dequantised shard by shard; logits equal transformers' on the dequantised weights.

- Qwen3.5's FP8 releases (``Qwen/Qwen3.5-*-FP8``): ``quant_method: fp8`` block-scaled e4m3 with
  ``weight_scale_inv``, Qwen's config (no ``fmt``, ``modules_to_not_convert``). Quantized: attention
  q/k/v/o, the Gated DeltaNet ``in_proj_qkv``, ``in_proj_z``, ``out_proj``, the MLPs, routed and
  shared experts; kept bf16: ``in_proj_a``/``in_proj_b``, ``conv1d``, norms, ``A_log``/``dt_bias``, the
  router and ``shared_expert_gate``, embeddings, ``lm_head``, the vision tower (the tensors MaxText's
  Qwen3.5-FP8 converter reads with and without ``_scale_inv``).
- NVIDIA ModelOpt NVFP4 of Qwen3.5 MoE (routed and shared experts; the rest bf16: an assumption, see
  docs/formats.md) and of Nemotron-3 (``hf_quant_config.json``: everything NVFP4 but the attention
  layers and the Mamba layers feeding them, ``lm_head``), and Nemotron-3's ModelOpt FP8 (per-tensor
  scales, the same exclusions); the FP8 KV-cache scales go to the report.

Blocks of 48 and groups of 16 against the tiny widths (64, head rows of 32): shard edges on the 2x4 mesh
cut through blocks, and the per-head reshapes of ``q_proj`` / ``in_proj_z`` cut through blocks too.
The published configs plan at full size with these layouts in tests/families/test_hybrid_quantized_realsize.py.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import otfload
from tests.families import test_nemotron_h, test_qwen3_5  # noqa: F401  (registers the tiny kinds)
from tests.helpers import jax_logits, max_rel_diff, token_ids, torch_logits
from tests.index.quant import layouts
from tests.quantized_fixtures import quantized_factory

BLOCK = 48
# Qwen's FP8 config as its FP8 releases write it (no "fmt"); the module list is Qwen's style.
QWEN_FP8 = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}
QWEN_KEPT = ("linear_attn.in_proj_a", "linear_attn.in_proj_b", "linear_attn.conv1d", "mlp.gate",
             "mlp.shared_expert_gate", "input_layernorm", "post_attention_layernorm")


def qwen_fp8_config(prefix: str, layers: int) -> dict:
    kept = [f"{prefix}.layers.{i}.{m}" for i in range(layers) for m in QWEN_KEPT]
    return {**QWEN_FP8, "modules_to_not_convert": ["lm_head", "model.visual", *kept]}


def qwen_quantized(key: str) -> bool:
    """What Qwen3.5's FP8 releases store in e4m3: every linear but the vision tower, ``in_proj_a/b``,
    the router and the shared expert's gate."""
    linear = layouts.is_linear(key) or key.endswith(("in_proj_qkv.weight", "in_proj_z.weight"))
    return linear and ".visual." not in key and not key.endswith(("in_proj_a.weight", "in_proj_b.weight"))


def qwen_experts(key: str) -> bool:
    return layouts.is_linear(key) and (".experts." in key or ".shared_expert." in key)


# Nemotron's tiny pattern (Mamba, attention, MoE, Mamba, MLP): layer 0 feeds the attention layer 1.
NEMOTRON_KEPT = ["lm_head", "backbone.layers.0.mixer.in_proj", "backbone.layers.0.mixer.out_proj",
                 *(f"backbone.layers.1.mixer.{p}_proj" for p in "qkvo")]


def nemotron_quantized(key: str) -> bool:
    return layouts.is_linear(key) and key[: -len(".weight")] not in NEMOTRON_KEPT


NEMOTRON_NVFP4 = layouts.SideFile(producer={"name": "modelopt", "version": "0.29.0"},
                                  quantization={"quant_algo": "NVFP4", "kv_cache_quant_algo": "FP8",
                                                "group_size": 16, "exclude_modules": NEMOTRON_KEPT})
NEMOTRON_FP8 = layouts.SideFile(producer={"name": "modelopt", "version": "0.29.0"},
                                quantization={"quant_algo": "FP8", "kv_cache_quant_algo": "FP8",
                                              "exclude_modules": NEMOTRON_KEPT})
QWEN_NVFP4 = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16,
              "exclude_modules": ["lm_head", "model.visual*", "*linear_attn*", "*self_attn*", "*mlp.gate",
                                  "*shared_expert_gate", "mtp*"]}

# name -> (tiny kind, selector, quantizer, quantization config)
LAYOUTS = {
    "qwen3_5_fp8": ("qwen3_5_multimodal", qwen_quantized, layouts.fp8_blocks((BLOCK, BLOCK)),
                    qwen_fp8_config("model.language_model", 5)),
    "qwen3_5_moe_fp8": ("qwen3_5_moe", qwen_quantized, layouts.fp8_blocks((BLOCK, BLOCK)),
                        qwen_fp8_config("model", 5)),
    "qwen3_5_moe_nvfp4": ("qwen3_5_moe", qwen_experts, layouts.modelopt_nvfp4, QWEN_NVFP4),
    "nemotron_h_nvfp4": ("nemotron_h", nemotron_quantized, layouts.modelopt_nvfp4, NEMOTRON_NVFP4),
    "nemotron_h_fp8": ("nemotron_h", nemotron_quantized, layouts.modelopt_fp8, NEMOTRON_FP8),
}
KV_SCALES = {"nemotron_h_nvfp4": ("backbone.layers.1.mixer.k_proj.k_scale", "backbone.layers.1.mixer.v_proj.v_scale"),
             "nemotron_h_fp8": ("backbone.layers.1.mixer.k_proj.k_scale", "backbone.layers.1.mixer.v_proj.v_scale")}


def _with_kv_scales(path, keys) -> None:
    """ModelOpt's FP8 KV-cache scales beside the (bf16) attention projections, as its exports add them."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    index_file = path / "model.safetensors.index.json"
    index = json.loads(index_file.read_text())
    shard = path / sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(shard)
    for key in keys:
        tensors[key] = torch.tensor(0.125)
        index["weight_map"][key] = shard.name
    save_file(tensors, shard, metadata={"format": "pt"})
    index_file.write_text(json.dumps(index))


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory):
    """``quantized(layout) -> QuantizedCheckpoint(dir, float torch model, reference dequantised torch model,
    reference dequantised values)``, the KV-cache scales added where ``KV_SCALES`` names them."""
    return quantized_factory(tiny_checkpoints, tmp_path_factory, LAYOUTS,
                             lambda layout, path: _with_kv_scales(path, KV_SCALES.get(layout, ())))


# Both scan values on the dense Qwen3.5 and the MoE's two layouts; Nemotron's two layouts scanned, one
# program (the same model's structure, shapes and mesh) for both.
@pytest.mark.parametrize(("layout", "scan_layers"), [
    ("qwen3_5_fp8", True), ("qwen3_5_fp8", False), ("qwen3_5_moe_fp8", True), ("qwen3_5_moe_nvfp4", False),
    ("nemotron_h_nvfp4", True), ("nemotron_h_fp8", True),
])  # fmt: skip
def test_logits_match_transformers_on_the_dequantised_weights(quantized, mesh_2x4, layout, scan_layers):
    path, _, reference_model, reference = quantized(layout)
    model, report = otfload.from_pretrained(path, mesh=mesh_2x4, dtype="float32", scan_layers=scan_layers,
                                            return_report=True)
    assert all(".visual." in k for k in report.unused_tensors)  # every code, scale and block used
    for key in KV_SCALES.get(layout, ()):
        assert report.activation_scales[key] == 0.125
    ids = token_ids(seq=70)  # more than one chunk, a ragged last one
    with jax.set_mesh(mesh_2x4):
        diff = max_rel_diff(jax_logits(model, ids), torch_logits(reference_model, ids))
    assert diff <= 1e-4, diff


def test_the_quantized_leaves_hold_the_dequantised_values(quantized, mesh_2x4):
    """Unscanned Qwen3.5 FP8: the fused ``in_proj_qkv`` as stored, ``in_proj_z`` and the gated ``q_proj``
    reshaped per head through 48-row blocks, equal to the numpy dequantisation; ``in_proj_a`` bf16."""
    path, *_, reference = quantized("qwen3_5_fp8")
    model = otfload.from_pretrained(path, mesh=mesh_2x4, dtype="float32", scan_layers=False)
    p = "model.language_model.layers"
    lin, attn = model.linear_layers[0].linear_attn, model.attention_layers[0].attn
    np.testing.assert_array_equal(np.asarray(lin.qkv.kernel[...]), reference[f"{p}.0.linear_attn.in_proj_qkv.weight"])
    np.testing.assert_array_equal(np.asarray(lin.z.kernel[...]).reshape(32, 64),
                                  reference[f"{p}.0.linear_attn.in_proj_z.weight"])
    np.testing.assert_array_equal(np.asarray(attn.q.kernel[...]).reshape(128, 64),
                                  reference[f"{p}.2.self_attn.q_proj.weight"])
    assert f"{p}.0.linear_attn.in_proj_a.weight" not in reference
