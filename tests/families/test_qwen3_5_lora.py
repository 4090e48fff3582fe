"""PEFT LoRA on Qwen3.5 MoE with its routed experts fused, as the bfloat16 releases store them
(test_qwen3_5_fused's tiny checkpoint): an adapter PEFT builds on transformers' model, on the
projections PEFT targets (transformers' runtime names: the Gated DeltaNet's ``in_proj_qkv``,
``in_proj_z``, ``in_proj_a``, ``in_proj_b`` and ``out_proj``, the gated attention's ``q_proj`` with its
gate rows, ``k_proj``, ``v_proj``, ``o_proj``, the shared expert's MLP and gate and, through
``target_parameters``, the fused ``mlp.experts.gate_up_proj``/``down_proj``), loaded merged on the fly
and kept as factors: float32 logits equal those of ``PeftModel.merge_and_unload()``, which the adapter
moves well past the bound. Keeping the fused experts' factors is a typed error naming the module."""

import jax
import pytest

import otfload
from otfload.errors import AdapterError
from otfload.plan.sharding import make_mesh
from tests.adapters.support import kept_factors, make_adapter, merged_peft_logits
from tests.adapters.test_parity import MIN_EFFECT, TOLERANCE
from tests.families.checks import reference_logits
from tests.families.test_qwen3_5_fused import fused  # noqa: F401  (the fused tiny checkpoint and its model)
from tests.helpers import jax_logits, max_rel_diff, token_ids

LINEAR = ["in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b", "out_proj"]
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
SHARED = ["gate_proj", "up_proj", "down_proj", "shared_expert_gate"]  # the routed experts are parameters
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def mesh():
    return make_mesh({"fsdp": 2, "tp": 4})  # test_qwen3_5's MoE mesh


@pytest.mark.parametrize(
    ("merge_adapter", "lora"),
    [
        (True, dict(target_modules=LINEAR + ATTENTION + SHARED, target_parameters=EXPERTS)),
        (False, dict(target_modules=LINEAR + ATTENTION + SHARED)),
    ],
    ids=["merged", "kept"],
)
def test_peft_lora_matches_peft_merged(fused, tmp_path, merge_adapter, lora):  # noqa: F811
    path, torch_model = fused
    adapter = make_adapter(torch_model, tmp_path / "adapter", r=2, lora_alpha=4, **lora)
    ids = token_ids(seq=70)
    reference = merged_peft_logits(torch_model, adapter, ids)
    model = otfload.from_pretrained(path, adapter=adapter, merge_adapter=merge_adapter, mesh=mesh())
    assert bool(kept_factors(model)) != merge_adapter
    with jax.set_mesh(mesh()):
        diff = max_rel_diff(jax_logits(model, ids), reference)
    assert diff <= TOLERANCE, diff
    assert max_rel_diff(reference_logits(torch_model, ids), reference) > MIN_EFFECT


def test_keeping_the_fused_experts_factors_is_refused_by_module(fused, tmp_path):  # noqa: F811
    path, torch_model = fused
    adapter = make_adapter(
        torch_model, tmp_path / "experts", r=2, lora_alpha=4, target_modules=[], target_parameters=EXPERTS
    )
    with pytest.raises(AdapterError, match=r"module 'model\.layers\.\d+\.mlp\.experts'.+target_parameters"):
        otfload.from_pretrained(path, adapter=adapter, merge_adapter=False, mesh=mesh())
