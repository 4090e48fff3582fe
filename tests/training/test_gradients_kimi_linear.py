"""Training as loaded, for Kimi-Linear: gradients equal PyTorch autograd's (the KDA mixers through
their chunked per-channel recurrence, short convs, low-rank decay and gate and gated norm; MLA
without rotation; the dense MLPs; the router, the routed and the shared experts) and a step lowers
the loss, with :mod:`tests.training.test_gradients`' helpers and bars. The gradients' dense MLPs are
exported under the releases' names (``mlp.*``), transformers' under ``block_sparse_moe.*_proj``."""

import pytest

from otfload.plan.sharding import make_mesh
from tests.families.test_kimi_linear import as_released
from tests.training.test_gradients import MOE_MESH, check_step
from tests.training.test_gradients_gqa_families import assert_grads_match_unrouted_too


def _match_released(ours: dict, ref_grads: dict) -> None:
    assert_grads_match_unrouted_too(ours, {as_released(k): v for k, v in ref_grads.items()})


@pytest.mark.parametrize(("kind", "scan_layers"), [("kimi_linear", True), ("kimi_linear_q_lora", False)])
def test_gradients_equal_torch_autograd_and_a_step_lowers_the_loss(tiny_checkpoints, tmp_path, kind, scan_layers):
    check_step(tiny_checkpoints, tmp_path, kind, make_mesh(MOE_MESH), scan_layers, match=_match_released)
