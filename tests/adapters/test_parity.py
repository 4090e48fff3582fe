"""PEFT LoRA adapters merged on the fly: logits equal ``peft.PeftModel``'s on the transformers model
(f32, ≤ 1e-4 × max|logits|), scanned and unscanned, on meshes that cut every matrix, so each device
merges only its own box of the delta."""

from __future__ import annotations

import numpy as np
import pytest

import otfload
from otfload.plan.sharding import make_mesh
from tests.adapters.support import peft_logits
from tests.families.moe_helpers import MESHES
from tests.helpers import hf_tensors, jax_logits, max_rel_diff, token_ids, torch_logits

TOLERANCE = 1e-4
# The adapters must move the logits far more than the tolerance, or parity would prove nothing.
MIN_EFFECT = 1e-3
DENSE = ["llama_patterns", "qwen3_rslora_embed_head", "llama_tied_embed", "qwen3_tied_head", "llama_bf16",
         "llama_two", "qwen3_three"]
MOE = ["mixtral_per_expert", "qwen3_moe_per_expert", "mixtral_fused", "qwen3_moe_fused", "gpt_oss_fused"]


def paired(names: list[str]) -> list[tuple[str, bool]]:
    """Each adapter set once, scanned and unscanned alternating, and the first both ways: every set and
    both ``scan_layers`` values are covered without every pair (the merge is per device box either way;
    scanning changes only how the merged slices are stacked, checked both ways on the first set)."""
    return [(name, i % 2 == 0) for i, name in enumerate(names)] + [(names[0], False)]


def parity(peft_adapters, name: str, mesh, scan_layers: bool) -> tuple[float, float]:
    """(otfload vs PEFT, base vs PEFT) max relative logits differences."""
    path, torch_model, adapters = peft_adapters(name)
    ids = token_ids()
    reference = peft_logits(torch_model, adapters, ids)
    adapter = adapters[0] if len(adapters) == 1 else adapters
    model = otfload.from_pretrained(path, adapter=adapter, mesh=mesh, scan_layers=scan_layers)
    return max_rel_diff(jax_logits(model, ids), reference), max_rel_diff(torch_logits(torch_model, ids), reference)


@pytest.mark.parametrize(("name", "scan_layers"), paired(DENSE))
def test_dense_logits_match_peft(peft_adapters, mesh_2x4, name, scan_layers):
    diff, effect = parity(peft_adapters, name, mesh_2x4, scan_layers)
    assert diff <= TOLERANCE, diff
    assert effect > MIN_EFFECT, effect


@pytest.mark.parametrize(("name", "scan_layers"), paired(MOE))
def test_moe_logits_match_peft(peft_adapters, name, scan_layers):
    diff, effect = parity(peft_adapters, name, make_mesh(MESHES["fsdp2_ep4"]), scan_layers)
    assert diff <= TOLERANCE, diff
    assert effect > MIN_EFFECT, effect


def test_tied_model_is_untied_like_peft(peft_adapters, mesh_2x4):
    """LoRA on the tied embedding: the embedding is adapted, the head keeps the base weight."""
    path, _, (adapter,) = peft_adapters("llama_tied_embed")
    base = otfload.from_pretrained(path, mesh=mesh_2x4)
    model = otfload.from_pretrained(path, adapter=adapter, mesh=mesh_2x4)
    assert base.cfg.tie_word_embeddings and not model.cfg.tie_word_embeddings
    embedding = np.asarray(base.embed.embedding[...])
    np.testing.assert_array_equal(np.asarray(model.lm_head.kernel[...]), embedding)
    assert not np.allclose(np.asarray(model.embed.embedding[...]), embedding)


def test_adapter_bytes_are_read_and_reported(peft_adapters, mesh_2x4):
    path, _, (adapter,) = peft_adapters("llama_patterns")
    _, base = otfload.from_pretrained(path, mesh=mesh_2x4, return_report=True)
    _, report = otfload.from_pretrained(path, adapter=adapter, mesh=mesh_2x4, return_report=True)
    factors = sum(v.nbytes for v in hf_tensors(adapter).values())
    assert "@adapter0/adapter_model.safetensors" in report.files
    assert report.bytes_read - base.bytes_read == factors  # every factor once, nothing else
    assert report.bytes_placed == base.bytes_placed


def test_plan_shows_the_merge_and_load_params_takes_adapters(peft_adapters, mesh_2x4):
    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    path, _, (adapter,) = peft_adapters("llama_patterns")
    _, plan, src = otfload.plan_model(path, adapter=adapter, mesh=mesh_2x4)
    src.close()
    assert plan.leaves["layers.attn.q.kernel"].storage == "float32 + LoRA rank 8 (merged in float32)"
    assert plan.leaves["final_norm.scale"].storage == "float32"

    key = "model.layers.0.self_attn.q_proj.weight"
    abstract = {"q": jax.ShapeDtypeStruct((64, 64), np.float32,
                                          sharding=NamedSharding(mesh_2x4, PartitionSpec("tp", "fsdp")))}
    tree = otfload.load_params(path, abstract, {"q": key}, adapter=adapter)
    factors = hf_tensors(adapter)
    module = "base_model.model.model.layers.0.self_attn.q_proj"
    a, b = factors[f"{module}.lora_A.weight"], factors[f"{module}.lora_B.weight"]
    assert a.shape == (8, 64)  # rank_pattern "q_proj": 8; alpha 8 (no alpha_pattern entry matches): s = 1
    np.testing.assert_allclose(np.asarray(tree["q"]), hf_tensors(path)[key] + b @ a, rtol=1e-6, atol=1e-6)
