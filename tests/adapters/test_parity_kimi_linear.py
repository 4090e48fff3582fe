"""PEFT LoRA on Kimi-Linear merged on the fly: logits equal ``peft.PeftModel``'s on the transformers
model. The adapter names transformers' runtime modules, which the checkpoint stores under other
names: the KDA decay's ``forget_gate.f_a_proj``/``f_b_proj`` (``self_attn.f_a_proj`` stored), the
feed-forwards' ``mlp.`` (``block_sparse_moe.``) and the routed experts fused (``gate_up_proj`` of the
per-expert ``w1`` and ``w3``, ``down_proj`` of ``w2``); the MLA projections include the fused
``kv_a_proj_with_mqa`` the model reads as two leaves."""

from pathlib import Path

import jax

import otfload
import tests.families.test_kimi_linear  # noqa: F401  (registers the tiny models)
from otfload.plan.sharding import make_mesh
from tests.adapters.support import make_adapter, peft_logits
from tests.adapters.test_parity import MIN_EFFECT, TOLERANCE
from tests.helpers import jax_logits, max_rel_diff, token_ids, torch_logits

KDA = ["q_proj", "k_proj", "v_proj", "o_proj", "b_proj", "f_a_proj", "f_b_proj", "g_a_proj", "g_b_proj"]
LORA = dict(r=4, lora_alpha=8, target_modules=[*KDA, "kv_a_proj_with_mqa", "kv_b_proj", "gate_proj", "up_proj",
                                               "down_proj"],
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])


def test_logits_match_peft(tiny_checkpoints, tmp_path: Path):
    path, torch_model = tiny_checkpoints("kimi_linear")
    adapter = make_adapter(torch_model, tmp_path / "adapter", **LORA)
    ids = token_ids()
    reference = peft_logits(torch_model, [adapter], ids)
    mesh = make_mesh({"fsdp": 2, "ep": 4})  # experts merged per expert-parallel box
    model = otfload.from_pretrained(path, adapter=adapter, mesh=mesh)
    with jax.set_mesh(mesh):
        diff = max_rel_diff(jax_logits(model, ids), reference)
    assert diff <= TOLERANCE, diff
    assert max_rel_diff(torch_logits(torch_model, ids), reference) > MIN_EFFECT
