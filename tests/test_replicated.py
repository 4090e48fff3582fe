"""A mesh that divides no dimension of a leaf replicates it: a load says so once (a typed warning
naming the count, the first leaves and the bytes), and ``otfload inspect`` marks those leaves."""

from __future__ import annotations

import json
import math
import warnings

import jax
import pytest
from flax import nnx

import otfload
from otfload.plan.abstract import dotted
from otfload.plan.sharding import make_mesh
from otfload.replicated import ReplicatedLeavesWarning
from tests.cli.test_cli import otfload_cli


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints("llama")[0]


def test_a_mesh_dividing_nothing_warns_once_naming_count_leaves_and_bytes(llama):
    mesh = make_mesh({"fsdp": 7}, jax.devices()[:7])  # 7 divides none of the tiny model's sizes
    with pytest.warns(ReplicatedLeavesWarning) as caught:
        model = otfload.from_pretrained(llama, mesh=mesh)
    (warning,) = [w for w in caught if w.category is ReplicatedLeavesWarning]  # once per load
    placed = {dotted(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    assert all(a.sharding.is_fully_replicated for a in placed.values())  # what the warning is about
    # the leaves the rules would shard (not the norms, replicated by design), counted from the arrays
    sharded = make_mesh({"fsdp": 8})
    wanted = {dotted(path): var.get_value() for path, var in nnx.to_flat_state(nnx.state(
        otfload.from_pretrained(llama, mesh=sharded), nnx.Param))}
    expected = [p for p, a in wanted.items() if not a.sharding.is_fully_replicated]
    nbytes = sum(math.prod(placed[p].shape) * placed[p].dtype.itemsize for p in expected)
    text = str(warning.message)
    assert f"mesh {{'fsdp': 7}} divides no dimension of {len(expected)} leaves" in text
    assert f"{nbytes:,} bytes per device" in text and "and " in text and "more" in text
    assert not any("norm" in p for p in text.split("(", 1)[1].split(")")[0].split(", "))


def test_a_dividing_mesh_gives_no_warning(llama, mesh_2x4):
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedLeavesWarning)
        otfload.from_pretrained(llama, mesh=mesh_2x4)


def test_inspect_marks_the_replicated_leaves(llama):
    done = otfload_cli("inspect", llama, "--mesh", "fsdp=7", "--devices", "7", "--json")
    assert done.returncode == 0, done.stderr
    info = json.loads(done.stdout)
    marked = [leaf for leaf in info["leaves"] if leaf["replicated_by_mesh"]]
    assert marked and info["totals"]["replicated_by_mesh"] == len(marked) < len(info["leaves"])  # norms: not
    text = otfload_cli("inspect", llama, "--mesh", "fsdp=7", "--devices", "7").stdout
    assert text.count("REPLICATED: the mesh divides none of its dimensions") == len(marked)
    assert f"{len(marked)} leaves replicated: the mesh divides none of their dimensions" in text


def test_a_few_small_replicated_leaves_are_marked_not_warned(tiny_checkpoints, mesh_2x4):
    """Qwen2's key/value biases: 2 KV heads on tp=4 are replicated, a sliver of the model."""
    from otfload.replicated import WARN_SHARE, replicated_leaves

    path = tiny_checkpoints("qwen2")[0]
    _, plan, src = otfload.plan_model(path, mesh=mesh_2x4)
    src.close()
    leaves = {p: lp.leaf for p, lp in plan.leaves.items()}
    found = replicated_leaves(leaves)
    total = sum(math.prod(leaf.shape) * leaf.dtype.itemsize for leaf in leaves.values())
    assert found.paths and all("bias" in p for p in found.paths) and found.nbytes < WARN_SHARE * total
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReplicatedLeavesWarning)
        otfload.from_pretrained(path, mesh=mesh_2x4)
