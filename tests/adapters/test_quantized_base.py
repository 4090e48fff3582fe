"""Adapters on quantized bases: each device box is dequantised and the LoRA delta added in float32,
in one decode (the base's parts read as ``base.<role>``). Reference: ``peft.PeftModel`` on
transformers' model of the exactly dequantised weights."""

from __future__ import annotations

import numpy as np
import pytest

import otfload
from otfload.plan.sharding import make_mesh
from tests.adapters.support import ALL_PROJECTIONS, DOWN, GATE_UP, make_adapter, peft_logits
from tests.families.moe_helpers import MESHES
from tests.helpers import jax_logits, max_rel_diff, token_ids
from tests.index.quant import layouts

TOLERANCE = 1e-4
QUANTIZED = {"fp8_blocks_llama": "fp8 float8_e4m3fn", "mxfp4_gpt_oss_fused": "mxfp4"}
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [48, 48]}
# name -> (kind, selector, quantizer, quantization_config, LoRA config, mesh)
CASES = {
    "fp8_blocks_llama": ("llama", layouts.is_linear, layouts.fp8_blocks((48, 48)), FP8_CONFIG,
                         dict(r=4, lora_alpha=8, target_modules=ALL_PROJECTIONS), {"fsdp": 2, "tp": 4}),
    "mxfp4_gpt_oss_fused": ("gpt_oss", layouts.is_gpt_oss_expert, layouts.mxfp4_experts, layouts.MXFP4_CONFIG,
                            dict(r=2, lora_alpha=4, target_modules=["q_proj"], target_parameters=[GATE_UP, DOWN]),
                            MESHES["fsdp2_ep4"]),
}


@pytest.fixture(scope="module")
def quantized(tiny_checkpoints, tmp_path_factory):
    """``quantized(name) -> (checkpoint, adapter, PEFT's logits)``, built once per case for both scan values."""
    made: dict = {}

    def get(name: str):
        if name not in made:
            kind, select, quantize, config, lora, mesh = CASES[name]
            src, torch_model = tiny_checkpoints(kind)
            root = tmp_path_factory.mktemp(name)
            reference = layouts.quantize_checkpoint(src, root / "ckpt", select, quantize, config)
            ref_model = layouts.load_reference(torch_model, reference, src, root / "reference")
            adapter = make_adapter(torch_model, root / "adapter", **lora)
            made[name] = root / "ckpt", adapter, peft_logits(ref_model, [adapter], token_ids())
        return made[name]

    return get


@pytest.mark.parametrize("scan_layers", [True, False])
@pytest.mark.parametrize("name", sorted(CASES))
def test_quantized_base_with_adapter_matches_peft(quantized, name, scan_layers):
    *_, lora, mesh = CASES[name]
    ckpt, adapter, want = quantized(name)
    _, plan, source = otfload.plan_model(ckpt, adapter=adapter, mesh=make_mesh(mesh), dtype="float32")
    source.close()
    adapted_quantized = [p for p in plan.leaves.values() if p.storage.startswith(QUANTIZED[name])]
    assert adapted_quantized and all(p.storage.endswith("+ LoRA rank {} (merged in float32)".format(lora["r"]))
                                     for p in adapted_quantized)
    model = otfload.from_pretrained(ckpt, adapter=adapter, mesh=make_mesh(mesh), dtype="float32",
                                    scan_layers=scan_layers)
    ids = token_ids()
    diff = max_rel_diff(jax_logits(model, ids), want)
    assert diff <= TOLERANCE, diff
    if scan_layers:  # the adapter moves the logits past the tolerance (the base alone, once per case)
        base = otfload.from_pretrained(ckpt, mesh=make_mesh(mesh), dtype="float32")
        assert max_rel_diff(jax_logits(base, ids), want) > 1e-3
    assert np.isfinite(want).all()
