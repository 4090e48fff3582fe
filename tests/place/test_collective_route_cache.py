"""The read-layout chooser costs each distinct read once (issue 42): a leaf's boxes that read the same
source region of the same stacked tensors are costed once per leaf (``LeafFetches``), and the
pieces of one region once for all its stacked tensors (``selection_piece_arrays``). Its choices are
the uncached chooser's, field for field, on every leaf of a fused-expert Qwen3.5 MoE (the gate and
up halves of one ``gate_up_proj``) and of an unscanned Mixtral, whose layers' leaves differ only in
their tensors' file offsets; 4 processes × 2 of the 8 CPU devices, cold and warm, by time and by
bytes."""

from __future__ import annotations

import functools

import pytest

import otfload
import tests.families.test_qwen3_5  # noqa: F401  (registers the tiny qwen3_5_moe with tiny_checkpoints)
from benchmarks.make_checkpoint import Dims, write_checkpoint
from otfload.accounting.gaps import PAGE_BYTES
from otfload.place import collective_route
from otfload.place.collective_route import FETCH_TARGET, choose_leaf, process_devices, time_model
from otfload.plan import boxes
from otfload.plan.sharding import make_mesh
from otfload.read.planned import leaf_planned
from otfload.read.reader import TensorReader
from tests.maxtext.make_refs import fused_copy

# (policy, cold): auto on a cold disk (bytes first, then time), auto warm (time), always (bytes).
MODES = [("auto", True), ("auto", False), ("always", True)]


def process_of(device) -> int:
    return device.id // 2


@pytest.fixture(scope="module")
def fused_plan(tiny_checkpoints, tmp_path_factory):
    src, _ = tiny_checkpoints("qwen3_5_moe")
    path = fused_copy(src, tmp_path_factory.mktemp("fused") / "qwen3_5_moe")
    _, plan, source = otfload.plan_model(path, mesh=make_mesh({"fsdp": 2, "ep": 4}))
    yield plan, source
    source.close()


@pytest.fixture(scope="module")
def unscanned_plan(tmp_path_factory):
    dims = Dims(hidden=512, intermediate=1408, layers=2, experts=4, vocab=4096)
    path = write_checkpoint(tmp_path_factory.mktemp("moe") / "mixtral", dims, shard_bytes=8 * 10**6)
    _, plan, source = otfload.plan_model(path, mesh=make_mesh({"fsdp": 2, "tp": 4}), scan_layers=False)
    yield plan, source
    source.close()


def choices(plan, source, monkeypatch, cached: bool) -> tuple[dict, int]:
    """``({(leaf, policy, cold): Choice}, calls of leaf_planned)`` of every leaf in every mode, with the
    caches or without them (each box set costed by leaf_planned, each region's pieces built anew)."""
    calls = 0

    def counted(plan, boxes_, reader):
        nonlocal calls
        calls += 1
        return leaf_planned(plan, boxes_, reader)

    reader = TensorReader(source)
    groups = process_devices(next(iter(plan.leaves.values())).leaf.sharding.mesh, process_of)
    out = {}
    with monkeypatch.context() as patch:
        patch.setattr(collective_route, "leaf_planned", counted)
        if not cached:
            patch.setattr(collective_route, "LeafFetches", lambda p, r: functools.partial(counted, p, reader=r))
            patch.setattr(boxes, "_piece_arrays", boxes._build_piece_arrays)
        for path, p in plan.leaves.items():
            for policy, cold in MODES:
                model = time_model(reader, len(groups), "cpu", cold)
                target = FETCH_TARGET if cold else None
                out[path, policy, cold] = choose_leaf(p, reader, groups, model, policy, target)
    return out, calls


@pytest.mark.parametrize("name", ["fused_plan", "unscanned_plan"])
def test_the_cached_chooser_chooses_as_the_uncached_one(name, request, monkeypatch):
    plan, source = request.getfixturevalue(name)
    cached, cached_calls = choices(plan, source, monkeypatch, cached=True)
    uncached, uncached_calls = choices(plan, source, monkeypatch, cached=False)
    assert cached == uncached
    assert any(c.sharding is not None for c in cached.values())  # some leaves are read as bands
    assert cached_calls < uncached_calls, (cached_calls, uncached_calls)  # direct reads and bands share regions


def test_leaves_that_differ_only_in_offset_are_costed_apart(unscanned_plan, monkeypatch):
    """The layers of an unscanned model read the same regions of tensors at other page offsets, and
    some of them fetch other byte counts for it: a cache that merged them would fail above."""
    plan, source = unscanned_plan
    chosen, _ = choices(plan, source, monkeypatch, cached=True)
    pairs = [(path, path.replace("layers.0.", "layers.1.")) for path in plan.leaves if path.startswith("layers.0.")]
    assert pairs
    pages = {path: [info.offset % PAGE_BYTES for info in plan.leaves[path].sources] for pair in pairs for path in pair}
    apart = [(a, b) for a, b in pairs if pages[a] != pages[b]]
    assert apart, pages
    assert any(chosen[a, *mode] != chosen[b, *mode] for a, b in apart for mode in MODES)
