"""Training as loaded, for Llama 4: gradients equal PyTorch autograd's (router, fused experts split
into gate and up, shared expert, dense MLPs, attention on RoPE/chunked and NoPE layers) and a step
lowers the loss, with :mod:`tests.training.test_gradients`' helpers and bars."""

import pytest

import tests.families.test_llama4  # noqa: F401  (registers the tiny models)
from otfload.plan.sharding import make_mesh
from tests.training.test_gradients import MOE_MESH, check_step
from tests.training.test_gradients_gqa_families import assert_grads_match_unrouted_too


# One scan mode per model (as in tests.training.test_gradients; both modes' forward parity is in
# tests/families/test_llama4.py): Llama 4 unscanned (its RoPE/chunked and NoPE layers each their own),
# the plain variant scanned.
@pytest.mark.parametrize(("kind", "scan_layers"), [("llama4", False), ("llama4_plain", True)])
def test_gradients_equal_torch_autograd_and_a_step_lowers_the_loss(tiny_checkpoints, tmp_path, kind, scan_layers):
    match = assert_grads_match_unrouted_too
    check_step(tiny_checkpoints, tmp_path, kind, make_mesh(MOE_MESH), scan_layers, match=match, pad_row=False)
