"""``Rule.only``: rules for the same leaf paths chosen by the path's layer index (layers of two kinds
whose leaves share paths but not shapes, as MaxText's unscanned Gemma 4: a global layer every sixth),
checked against the tensors written out by hand in numpy."""

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import otfload
from otfload.errors import CheckpointMismatchError, MappingError
from otfload.plan.mapping import MappingTable, Rule, Stride
from tests.helpers import hf_tensors
from tests.synthetic import write_checkpoint

SOURCE = "model.layers.{layer}.q.weight"
GLOBAL = Rule("layers_{layer}.q", SOURCE, only={"layer": (Stride(3, 2),)})
SLIDING = Rule("layers_{layer}.q", SOURCE, only={"layer": (Stride(3, 0), Stride(3, 1))})
TABLE = MappingTable((GLOBAL, SLIDING))
LAYERS, NARROW, WIDE = 6, 4, 8


def test_the_layer_index_chooses_the_rule():
    assert [TABLE.find(f"layers_{i}.q")[0] is GLOBAL for i in range(LAYERS)] == [False, False, True] * 2
    assert GLOBAL.match("layers_5.q") == ({"layer": 5}, ())
    assert GLOBAL.match("layers_4.q") is None and GLOBAL.match("layers_5.k") is None


def test_listed_indices_as_a_config_layer_type_list_gives_them():
    types = ["sliding", "full", "sliding", "sliding", "full"]
    rule = Rule("layers_{layer}.q", SOURCE, only={"layer": tuple(i for i, t in enumerate(types) if t == "full")})
    assert [i for i in range(len(types)) if rule.match(f"layers_{i}.q")] == [1, 4]


def test_a_leaf_stacking_the_placeholder_is_not_matched():
    scanned = Rule("layers.{layer}.q", SOURCE)
    assert scanned.match("layers.q") == ({}, ("layer",))
    assert Rule("layers.{layer}.q", SOURCE, only={"layer": (5,)}).match("layers.q") is None


def test_only_must_name_a_target_placeholder_with_literal_values():
    with pytest.raises(MappingError, match="names no placeholder"):
        Rule("layers.q", SOURCE, only={"layer": (1,)})
    with pytest.raises(MappingError, match="Strides of ints"):
        Rule("layers_{layer}.q", SOURCE, only={"layer": (Stride("period", 2),)})
    with pytest.raises(MappingError, match="literal"):
        _ = 3 in Stride("period")


def _checkpoint(tmp_path, width):
    rng = np.random.default_rng(0)
    tensors = {SOURCE.format(layer=i): rng.standard_normal((width(i), 4)).astype(np.float32) for i in range(LAYERS)}
    return write_checkpoint(tmp_path / "ckpt", tensors, config={"model_type": "synthetic"}), tensors


def _tree(mesh, width):
    sharding = NamedSharding(mesh, P("tp", None))
    return {f"layers_{i}": {"q": jax.ShapeDtypeStruct((width(i), 4), np.float32, sharding=sharding)}
            for i in range(LAYERS)}


def _width(i):
    return WIDE if i % 3 == 2 else NARROW


def test_each_kind_loads_with_its_shape_and_exports_back(tmp_path, mesh_2x4):
    path, tensors = _checkpoint(tmp_path, _width)
    params = otfload.load_params(path, _tree(mesh_2x4, _width), TABLE, config={}, mesh=mesh_2x4)
    for i in range(LAYERS):
        np.testing.assert_array_equal(np.asarray(params[f"layers_{i}"]["q"]), tensors[SOURCE.format(layer=i)])
    otfload.export_hf(params, tmp_path / "out", mapping=TABLE, config={}, reference=path)
    assert {k: v.tobytes() for k, v in hf_tensors(tmp_path / "out").items()} == {
        k: v.tobytes() for k, v in tensors.items()}


def test_a_layer_of_the_other_kind_is_a_shape_problem_naming_it(tmp_path, mesh_2x4):
    path, _ = _checkpoint(tmp_path, _width)
    swapped = _tree(mesh_2x4, lambda i: NARROW if i == 5 else _width(i))
    with pytest.raises(CheckpointMismatchError, match="layers_5.q"):
        otfload.load_params(path, swapped, TABLE, config={}, mesh=mesh_2x4)
