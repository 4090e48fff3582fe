"""Training as loaded, for Llama 4: gradients equal PyTorch autograd's (router, fused experts split
into gate and up, shared expert, dense MLPs, attention on RoPE/chunked and NoPE layers) and a step
lowers the loss, with :mod:`tests.training.test_gradients`' helpers and bars."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import otfload
import tests.families.test_llama4  # noqa: F401  (registers the tiny models)
from otfload.plan.sharding import make_mesh
from tests.training.test_gradients import (
    LEARNING_RATE,
    MOE_MESH,
    PAD,
    batch,
    exported_grads,
    next_token_loss,
    torch_loss_and_grads,
    train_step,
    with_pad_id,
)
from tests.training.test_gradients_gqa_families import assert_grads_match_unrouted_too


@pytest.mark.parametrize(("kind", "scan_layers"), [("llama4", True), ("llama4", False), ("llama4_plain", True)])
def test_gradients_equal_torch_autograd_and_a_step_lowers_the_loss(tiny_checkpoints, tmp_path, kind, scan_layers):
    src, torch_model = tiny_checkpoints(kind)
    path = with_pad_id(src, tmp_path / "ckpt")
    mesh = make_mesh(MOE_MESH)
    model = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, dtype=jnp.float32)
    optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
    ids = batch()
    with jax.set_mesh(mesh):
        loss, grads = train_step(model, optimizer, jnp.asarray(ids))
        after = nnx.jit(next_token_loss)(model, jnp.asarray(ids))
    ref_loss, ref_grads = torch_loss_and_grads(torch_model, ids, PAD, tmp_path / "torch_grads")
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    assert_grads_match_unrouted_too(exported_grads(grads, path, tmp_path / "grads"), ref_grads)
    assert float(after) < float(loss)
