"""Training as loaded, for Nemotron-H: gradients equal PyTorch autograd's (the Mamba-2 mixers through
their chunked recurrence, conv and gated norm; attention without RoPE; the squared-ReLU MLP; the
router, the routed experts and the shared expert) and a step lowers the loss, with
:mod:`tests.training.test_gradients`' helpers and bars. transformers' embedding has no
``padding_idx`` here, so no row is kept out of the gradient on either side."""

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

import otfload
import tests.families.test_nemotron_h  # noqa: F401  (registers the tiny models)
from otfload.plan.sharding import make_mesh
from tests.training.test_gradients import (
    LEARNING_RATE,
    MOE_MESH,
    batch,
    exported_grads,
    next_token_loss,
    torch_loss_and_grads,
    train_step,
)
from tests.training.test_gradients_gqa_families import assert_grads_match_unrouted_too


@pytest.mark.parametrize(("kind", "scan_layers"), [("nemotron_h", True), ("nemotron_h_bias", False)])
def test_gradients_equal_torch_autograd_and_a_step_lowers_the_loss(tiny_checkpoints, tmp_path, kind, scan_layers):
    path, torch_model = tiny_checkpoints(kind)
    mesh = make_mesh(MOE_MESH)
    model = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, dtype=jnp.float32)
    optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
    ids = batch()
    with jax.set_mesh(mesh):
        loss, grads = train_step(model, optimizer, jnp.asarray(ids))
        after = nnx.jit(next_token_loss)(model, jnp.asarray(ids))
    ref_loss, ref_grads = torch_loss_and_grads(torch_model, ids, None, tmp_path / "torch_grads")
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    assert_grads_match_unrouted_too(exported_grads(grads, path, tmp_path / "grads"), ref_grads)
    assert float(after) < float(loss)
