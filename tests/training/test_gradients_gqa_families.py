"""Training as loaded, for the GQA families assembled from ``otfload.models``' blocks (OLMo 3,
GLM-4.5, MiniMax-M2): gradients equal PyTorch autograd's and a step lowers the loss, exactly as
:mod:`tests.training.test_gradients` checks the older families (its helpers, its bars)."""

import numpy as np
import pytest

import tests.families.test_glm4_moe  # noqa: F401  (registers the tiny models)
import tests.families.test_minimax_m2  # noqa: F401
import tests.families.test_olmo3  # noqa: F401
from otfload.plan.sharding import make_mesh
from tests.training.test_gradients import (
    DENSE_MESH,
    MOE_MESH,
    assert_grads_match,
    check_step,
)


def assert_grads_match_unrouted_too(ours: dict, ref: dict) -> None:
    """:func:`assert_grads_match`, where an expert no token of the batch was routed to (8 experts, one
    group of 4 kept per token: some go unused) has no gradient in either."""
    unrouted = {k for k, g in ref.items() if ".experts." in k and not np.any(g)}
    for key in unrouted:
        assert not np.any(ours[key]), key
    assert_grads_match({k: v for k, v in ours.items() if k not in unrouted},
                       {k: v for k, v in ref.items() if k not in unrouted})


# One scan mode per family (as in tests.training.test_gradients; both modes' forward parity is in each
# family's tests): OLMo 3 unscanned (its sliding and full layers as static windows), GLM-4.5's dense and
# MoE layer groups and MiniMax-M2 scanned.
CASES = [("olmo3", False), ("glm4_moe", True), ("minimax_m2", True)]


@pytest.mark.parametrize(("kind", "scan_layers"), CASES)
def test_gradients_equal_torch_autograd_and_a_step_lowers_the_loss(tiny_checkpoints, tmp_path, kind, scan_layers):
    mesh = make_mesh(DENSE_MESH if kind == "olmo3" else MOE_MESH)
    check_step(tiny_checkpoints, tmp_path, kind, mesh, scan_layers, match=assert_grads_match_unrouted_too)
