"""Training as loaded, for the GQA families assembled from ``otfload.models``' blocks (OLMo 3,
GLM-4.5, MiniMax-M2): gradients equal PyTorch autograd's and a step lowers the loss, exactly as
:mod:`tests.training.test_gradients` checks the older families (its helpers, its bars)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import otfload
import tests.families.test_glm4_moe  # noqa: F401  (registers the tiny models)
import tests.families.test_minimax_m2  # noqa: F401
import tests.families.test_olmo3  # noqa: F401
from otfload.plan.sharding import make_mesh
from tests.training.test_gradients import (
    DENSE_MESH,
    LEARNING_RATE,
    MOE_MESH,
    PAD,
    assert_grads_match,
    batch,
    exported_grads,
    next_token_loss,
    torch_loss_and_grads,
    train_step,
    with_pad_id,
)


def assert_grads_match_unrouted_too(ours: dict, ref: dict) -> None:
    """:func:`assert_grads_match`, where an expert no token of the batch was routed to (8 experts, one
    group of 4 kept per token: some go unused) has no gradient in either."""
    unrouted = {k for k, g in ref.items() if ".experts." in k and not np.any(g)}
    for key in unrouted:
        assert not np.any(ours[key]), key
    assert_grads_match({k: v for k, v in ours.items() if k not in unrouted},
                       {k: v for k, v in ref.items() if k not in unrouted})


CASES = [("olmo3", True), ("olmo3", False), ("glm4_moe", True), ("glm4_moe", False), ("minimax_m2", True)]


@pytest.mark.parametrize(("kind", "scan_layers"), CASES)
def test_gradients_equal_torch_autograd_and_a_step_lowers_the_loss(tiny_checkpoints, tmp_path, kind, scan_layers):
    src, torch_model = tiny_checkpoints(kind)
    path = with_pad_id(src, tmp_path / "ckpt")
    mesh = make_mesh(DENSE_MESH if kind == "olmo3" else MOE_MESH)
    model = otfload.from_pretrained(path, mesh=mesh, scan_layers=scan_layers, dtype=jnp.float32)
    optimizer = nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)
    ids = batch()
    with jax.set_mesh(mesh):
        loss, grads = train_step(model, optimizer, jnp.asarray(ids))
        after = nnx.jit(next_token_loss)(model, jnp.asarray(ids))
    ref_loss, ref_grads = torch_loss_and_grads(torch_model, ids, PAD, tmp_path / "torch_grads")
    assert abs(float(loss) - ref_loss) <= 1e-5 * ref_loss
    ours = exported_grads(grads, path, tmp_path / "grads")
    assert_grads_match_unrouted_too(ours, ref_grads)
    embed = "model.embed_tokens.weight"
    if not model.cfg.tie_word_embeddings:  # the pad row's only use is the lookup: no gradient
        assert not np.any(ours[embed][PAD]) and np.any(ours[embed][ids[0, 0]])
    assert float(after) < float(loss)
