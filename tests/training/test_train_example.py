"""examples/train.py as users run it, on a tiny Llama: the step compiled while loading trains,
the native checkpoint restores parameters and optimizer state exactly with its layout recorded,
and transformers reloads the exported weights with the trained model's logits."""

import runpy
from pathlib import Path

import jax
import numpy as np
from flax import nnx

import otfload
from otfload.checkpoint import CheckpointConfig, create_manager
from tests.helpers import jax_logits as logits
from tests.helpers import max_rel_diff, token_ids, torch_logits

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "train.py"
STEPS = 3


def test_train_example_trains_checkpoints_restores_and_exports(tiny_checkpoints, tmp_path):
    from transformers import AutoModelForCausalLM

    path, torch_model = tiny_checkpoints("llama")
    train = runpy.run_path(str(EXAMPLE), run_name="example")["train"]
    mesh = otfload.make_mesh({"fsdp": 2, "tp": 4})
    batch = token_ids(batch=2, seq=16)
    result = train(path, tmp_path, mesh=mesh, batch=batch, steps=STEPS)

    losses, times = result["losses"], result["times"]
    assert len(losses) == STEPS and all(b < a for a, b in zip(losses, losses[1:], strict=False)), losses
    assert times.planned < min(times.loaded, times.compiled) and times.ready == max(times.loaded, times.compiled)

    manager = create_manager(CheckpointConfig(tmp_path / "native"))
    assert manager.latest_step() == STEPS and manager.metadata().scan_layers is True
    manager.close()
    trained, restored = result["model"], result["restored"]
    for ours, back in ((trained, restored), (result["optimizer"], result["restored_optimizer"])):
        pairs = zip(jax.tree.leaves(nnx.state(ours)), jax.tree.leaves(nnx.state(back)), strict=True)
        for a, b in pairs:
            assert a.sharding == b.sharding
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert int(result["restored_optimizer"].step[...]) == STEPS

    ids = token_ids(seq=12)
    ours = logits(restored, ids)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype="float32").eval()
    assert max_rel_diff(ours, torch_logits(reloaded, ids)) <= 1e-4
    assert max_rel_diff(ours, torch_logits(torch_model, ids)) > 1e-4  # the steps changed the weights
