"""``Composed`` indices: one HF placeholder from the positions of two stack axes (a leaf stacking
layers twice, ``[blocks, position in block]``, as MaxText's scanned Qwen3-Next), checked against
the layer numbers written out by hand."""

import contextlib

import jax
import numpy as np
import pytest

from otfload.errors import MappingError
from otfload.index.checkpoint import open_index
from otfload.plan.abstract import abstract_from_pytree
from otfload.plan.mapping import Composed, MappingTable, Rule, format_key, hf_values, slice_values, stack_dims
from otfload.plan.planner import build_plan
from otfload.sources import LocalSource
from tests.synthetic import write_checkpoint

# blocks of 4 HF layers: three local ones (positions 0..2) then a global one
LOCAL = Composed(("block", "local"), "block * period + local")
NORM = Rule("local.norm", "model.layers.{layer}.norm.weight", indices={"layer": LOCAL},
            stack_at={"block": "scan_axis", "local": "scan_axis + 1"})
EXPERTS = Rule("local.experts", "model.layers.{layer}.experts.{expert}.w", indices={"layer": LOCAL},
               stack_at={"block": "scan_axis", "local": "scan_axis + 1"})
CONFIG = {"period": 4, "scan_axis": 1}


def test_the_composed_placeholder_is_replaced_by_its_axes():
    assert NORM.match("local.norm") == ({}, ("block", "local"))
    assert EXPERTS.match("local.experts") == ({}, ("block", "local", "expert"))


def test_each_slice_reads_block_times_period_plus_local():
    layers = [v["layer"] for _, v in slice_values(NORM, {}, ("block", "local"), (2, 3), CONFIG)]
    assert layers == [0, 1, 2, 4, 5, 6]
    values = hf_values(EXPERTS, {}, ("block", "local", "expert"), (1, 2, 3), CONFIG)
    assert format_key(EXPERTS.source, values) == "model.layers.6.experts.3.w"


def test_stack_at_places_both_axes_and_the_rest_take_the_lowest_dimensions():
    assert stack_dims(EXPERTS, ("block", "local", "expert"), 5, CONFIG) == (1, 2, 0)
    assert stack_dims(EXPERTS, ("block", "local", "expert"), 5, {**CONFIG, "scan_axis": 0}) == (0, 1, 2)


def test_a_composed_placeholder_in_the_target_path_is_refused():
    with pytest.raises(MappingError, match="composed of stack axes"):
        Rule("layers_{layer}.norm", "model.layers.{layer}.norm.weight", indices={"layer": LOCAL})


def test_the_planner_reads_each_block_and_position_and_says_which(tmp_path, mesh_2x4):
    rng = np.random.default_rng(0)
    tensors = {f"model.layers.{i}.norm.weight": rng.standard_normal(4).astype(np.float32) for i in range(8)}
    path = write_checkpoint(tmp_path / "ckpt", tensors, config={"model_type": "synthetic"})
    leaves, _ = abstract_from_pytree({"local": {"norm": jax.ShapeDtypeStruct((4, 2, 3), np.float32)}}, mesh_2x4)
    with contextlib.closing(LocalSource(path)) as source:
        plan = build_plan(open_index(source), leaves, MappingTable((NORM,)), CONFIG)
    leaf = plan.leaves["local.norm"]
    assert leaf.describe()["stack_values"] == {"block": [0, 1], "local": [0, 1, 2]}
    assert [s.name for s in leaf.sources] == [f"model.layers.{i}.norm.weight" for i in (0, 1, 2, 4, 5, 6)]
    assert sorted(plan.unused) == ["model.layers.3.norm.weight", "model.layers.7.norm.weight"]
