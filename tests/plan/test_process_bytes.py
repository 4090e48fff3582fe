"""A plan's per-process counts (otfload.plan.process_bytes): each leaf's own, though leaves that read
alike are counted once, and their sums the plan's totals (the per-leaf counts are checked against
independent references in tests/plan/test_leaf_bytes.py)."""

from __future__ import annotations

import pytest

import otfload
from otfload.plan.process_bytes import (
    FetchCount,
    ProcessBytes,
    fetch_totals,
    ideal_bytes,
    process_counts,
    process_totals,
)
from otfload.plan.sharding import make_mesh
from tests.families.moe_helpers import MESHES


@pytest.fixture(scope="module", autouse=True)
def _register_kinds():
    import tests.families.test_mixtral  # noqa: F401  (registers the tiny model kind)


@pytest.mark.parametrize(("kind", "axes"), [("llama", "fsdp2_tp4"), ("mixtral", "fsdp2_ep4")])
def test_process_counts_are_each_leafs_own_and_sum_to_the_plan_totals(tiny_checkpoints, kind, axes):
    # Unscanned layers read alike and are counted once: every leaf must still get its own counts.
    path, _ = tiny_checkpoints(kind)
    mesh = make_mesh(MESHES[axes])
    _, plan, src = otfload.plan_model(path, mesh=mesh, scan_layers=False)
    src.close()
    half = list(mesh.devices.flat)[:4]  # the first of two processes
    counts = process_counts(plan, half)
    assert counts == {path: ProcessBytes(p.process_bytes(half), p.ideal_bytes(half), p.shard_bytes())
                      for path, p in plan.leaves.items()}
    totals = process_totals(counts.values())
    assert totals.ideal == ideal_bytes(plan, half) > 0 and totals.needed >= totals.ideal
    assert totals.device == sum(p.shard_bytes() for p in plan.leaves.values())
    assert process_totals([]) == (0, 0, 0) and fetch_totals([FetchCount(1, 2), FetchCount(3, 4)]) == (4, 6)
