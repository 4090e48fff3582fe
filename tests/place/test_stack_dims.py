"""Stack axes placed anywhere in a leaf (``Rule.stack_at``): the leaves equal numpy's ``np.stack``
on that axis for every device box, every process reads what its devices need, export inverts it,
and an axis that does not fit the tree is an error naming it."""

import json

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import otfload
from otfload.errors import MappingError, ShapeMismatchError
from otfload.export.api import export_hf
from otfload.plan.hooks import Reshape, Transpose
from otfload.plan.mapping import MappingTable, Rule
from tests.synthetic import write_checkpoint

LAYERS, EXPERTS, EMBED, HEADS, HEAD_DIM, MLP = 2, 4, 8, 4, 3, 6
L, E = "model.layers.{layer}", "model.layers.{layer}.experts.{expert}"


def _table() -> MappingTable:
    at = {"layer": "scan_axis"}
    return MappingTable((
        Rule("layers.norm", f"{L}.norm.weight", stack_at=at),
        Rule("layers.q", f"{L}.q_proj.weight", (Transpose(), Reshape(("embed", "heads", -1))), stack_at=at),
        Rule("layers.experts_w", f"{E}.w.weight", (Transpose(),), stack_at=at),
    ))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    rng = np.random.default_rng(0)
    tensors = {}
    for i in range(LAYERS):
        tensors[f"model.layers.{i}.norm.weight"] = rng.standard_normal(EMBED).astype(np.float32)
        tensors[f"model.layers.{i}.q_proj.weight"] = rng.standard_normal((HEADS * HEAD_DIM, EMBED)).astype(np.float32)
        for e in range(EXPERTS):
            tensors[f"model.layers.{i}.experts.{e}.w.weight"] = rng.standard_normal((MLP, EMBED)).astype(np.float32)
    config = {"model_type": "synthetic", "embed": EMBED, "heads": HEADS}
    return write_checkpoint(tmp_path_factory.mktemp("stacked") / "ckpt", tensors, files=3, config=config), tensors


def _expected(tensors, axis):
    def stack(template, fn=lambda x: x):
        return np.stack([fn(tensors[template.format(layer=i)]) for i in range(LAYERS)], axis=axis)

    q = stack("model.layers.{layer}.q_proj.weight", lambda w: w.T.reshape(EMBED, HEADS, HEAD_DIM))
    experts = np.stack([np.stack([tensors[f"model.layers.{i}.experts.{e}.w.weight"].T for e in range(EXPERTS)])
                        for i in range(LAYERS)], axis=axis)  # [E, L, ...] on axis 1, [L, E, ...] on 0
    return {"layers.norm": stack("model.layers.{layer}.norm.weight"), "layers.q": q, "layers.experts_w": experts}


def _abstract(mesh, axis):
    def leaf(shape, spec):
        return jax.ShapeDtypeStruct(shape, np.float32, sharding=NamedSharding(mesh, spec))

    if axis == 1:  # MaxText's default param_scan_axis: the layer axis second, sharded too
        return {"layers": {
            "norm": leaf((EMBED, LAYERS), P("tp", "fsdp")),
            "q": leaf((EMBED, LAYERS, HEADS, HEAD_DIM), P("fsdp", None, "tp")),
            "experts_w": leaf((EXPERTS, LAYERS, EMBED, MLP), P("tp", "fsdp")),
        }}
    return {"layers": {
        "norm": leaf((LAYERS, EMBED), P("fsdp", "tp")),
        "q": leaf((LAYERS, EMBED, HEADS, HEAD_DIM), P(None, "fsdp", "tp")),
        "experts_w": leaf((LAYERS, EXPERTS, EMBED, MLP), P(None, "tp", "fsdp")),
    }}


@pytest.mark.parametrize("axis", [1, 0])
def test_leaves_equal_numpy_stacked_on_the_axis(checkpoint, mesh_2x4, axis):
    path, tensors = checkpoint
    config = {"embed": EMBED, "heads": HEADS, "scan_axis": axis}
    params, report = otfload.load_params(path, _abstract(mesh_2x4, axis), _table(), config=config,
                                         return_report=True)
    expected = _expected(tensors, axis)
    for name, want in expected.items():
        got = params["layers"][name.split(".")[1]]
        assert got.shape == want.shape
        assert got.sharding == _abstract(mesh_2x4, axis)["layers"][name.split(".")[1]].sharding
        np.testing.assert_array_equal(np.asarray(got), want)
        for shard in got.addressable_shards:  # each device holds its own box of the tree's layout
            np.testing.assert_array_equal(np.asarray(shard.data), want[shard.index])
    assert report.bytes_needed == sum(v.nbytes for v in tensors.values())  # each tensor read once


def test_export_inverts_the_placed_axis(checkpoint, mesh_2x4, tmp_path):
    path, tensors = checkpoint
    config = {"model_type": "synthetic", "embed": EMBED, "heads": HEADS, "scan_axis": 1}
    params = otfload.load_params(path, _abstract(mesh_2x4, 1), _table(), config=config)
    out = export_hf(params, tmp_path / "out", config=config, mapping=_table())
    from safetensors.numpy import load_file

    written = {}
    for file in out.glob("*.safetensors"):
        written.update(load_file(file))
    assert written.keys() == tensors.keys()
    for key, value in tensors.items():
        np.testing.assert_array_equal(written[key], value)
    assert json.loads((out / "config.json").read_text())["scan_axis"] == 1


def test_a_stack_axis_that_does_not_fit_names_the_axis_and_sizes(checkpoint, mesh_2x4):
    """A tree with the layer axis second loaded with the table set for it first: dim 0 (embed, 8)
    is taken for 8 layers, and the checkpoint has 2."""
    path, _ = checkpoint
    config = {"embed": EMBED, "heads": HEADS, "scan_axis": 0}
    abstract = {"layers": {"norm": _abstract(mesh_2x4, 1)["layers"]["norm"]}}
    with pytest.raises(ShapeMismatchError) as info:
        otfload.load_params(path, abstract, _table(), config=config)
    message = str(info.value)
    assert "stack axis 'layer' at dimension 0 ('scan_axis') with 8 entries" in message
    assert "2 layer tensors in the checkpoint" in message


def test_a_stack_position_outside_the_leaf_is_a_mapping_error(checkpoint, mesh_2x4):
    path, _ = checkpoint
    abstract = {"layers": {"norm": _abstract(mesh_2x4, 1)["layers"]["norm"]}}
    with pytest.raises(MappingError, match="stack axis 'layer' at dimension 5"):
        otfload.load_params(path, abstract, _table(), config={"scan_axis": 5})
