"""Training as loaded, for Kimi-Linear: gradients equal PyTorch autograd's (the KDA mixers through
their chunked per-channel recurrence, short convs, low-rank decay and gate and gated norm; MLA
without rotation; the dense MLPs; the router, the routed and the shared experts) and a step lowers
the loss, with :mod:`tests.training.test_gradients`' helpers and bars. The gradients' dense MLPs are
exported under the releases' names (``mlp.*``), transformers' under ``block_sparse_moe.*_proj``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import otfload
from otfload.plan.sharding import make_mesh
from tests.families.test_kimi_linear import as_released
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


@pytest.mark.parametrize(("kind", "scan_layers"), [("kimi_linear", True), ("kimi_linear_q_lora", False)])
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
    ours = exported_grads(grads, path, tmp_path / "grads")
    assert_grads_match_unrouted_too(ours, {as_released(k): v for k, v in ref_grads.items()})
    embed = "model.embed_tokens.weight"
    assert not np.any(ours[embed][PAD]) and np.any(ours[embed][ids[0, 0]])
    assert float(after) < float(loss)
