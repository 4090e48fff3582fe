import contextlib

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from otfload.errors import CheckpointMismatchError, MissingTensorError, ShapeMismatchError, UnexpectedTensorError
from otfload.index.checkpoint import open_index
from otfload.plan.abstract import abstract_from_pytree
from otfload.plan.hooks import Reshape, Transpose
from otfload.plan.mapping import MappingTable, Rule, Stride
from otfload.plan.planner import build_plan
from otfload.sources import LocalSource
from tests.synthetic import write_checkpoint

TABLE = MappingTable(
    (
        Rule("emb", "embed.weight"),
        Rule("head", "head.weight", (Transpose(),), fallbacks=("embed.weight",)),
        Rule("layers.{layer}.w", "layers.{layer}.w", (Transpose(), Reshape((4, "heads", -1)))),
        Rule("layers.{layer}.experts", "layers.{layer}.experts.{expert}.w"),
    ),
    ignore=(r".*\.inv_freq",),
)


@pytest.fixture
def checkpoint(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {"embed.weight": rng.standard_normal((10, 4), dtype=np.float32), "rope.inv_freq": np.ones(2, np.float32)}
    for layer in range(3):
        tensors[f"layers.{layer}.w"] = rng.standard_normal((6, 4), dtype=np.float32)
        for expert in range(2):
            tensors[f"layers.{layer}.experts.{expert}.w"] = rng.standard_normal((5,), dtype=np.float32)
    return write_checkpoint(tmp_path / "ckpt", tensors, config={"heads": 2})


def leaves_of(tree, mesh):
    shard = NamedSharding(mesh, P())
    tree = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, np.float32, sharding=shard), tree,
                        is_leaf=lambda x: isinstance(x, tuple))
    return abstract_from_pytree(tree)[0]


def plan(checkpoint, tree, mesh, **kw):
    with contextlib.closing(LocalSource(checkpoint)) as source:  # planning reads headers only
        index = open_index(source, require_config=False)
    return build_plan(index, leaves_of(tree, mesh), TABLE, index.config, **kw)


def test_scanned_plan_stacks_layers_and_experts_and_reads_tied_key_twice(checkpoint, mesh_2x4):
    result = plan(checkpoint, {"emb": (10, 4), "head": (4, 10), "layers": {"w": (3, 4, 2, 3), "experts": (3, 2, 5)}},
                  mesh_2x4)
    w, experts = result.leaves["layers.w"], result.leaves["layers.experts"]
    assert w.stack_axes == ("layer",) and [s.name for s in w.sources] == [f"layers.{i}.w" for i in range(3)]
    assert w.shapes == ((6, 4), (4, 6), (4, 2, 3))
    assert experts.stack_axes == ("layer", "expert")
    assert [s.name for s in experts.sources][:3] == ["layers.0.experts.0.w", "layers.0.experts.1.w",
                                                     "layers.1.experts.0.w"]
    assert result.leaves["head"].sources[0].name == "embed.weight"  # tied: falls back, nothing popped
    assert result.leaves["emb"].sources[0].name == "embed.weight"
    assert result.unused == []  # inv_freq is ignored, not unused
    assert result.leaves["layers.w"].describe()["num_hf_keys"] == 3


def test_unscanned_plan_fixes_one_layer_per_leaf(checkpoint, mesh_2x4):
    tree = {"layers": {str(i): {"w": (4, 2, 3)} for i in range(3)}}
    result = plan(checkpoint, tree, mesh_2x4)
    assert result.leaves["layers.1.w"].sources[0].name == "layers.1.w"
    assert result.leaves["layers.1.w"].stack_axes == ()
    assert "embed.weight" in result.unused


def test_all_problems_reported_at_once(checkpoint, mesh_2x4):
    tree = {"layers": {"w": (4, 4, 2, 3), "experts": (3, 2, 6)}, "nothing": (2,)}
    with pytest.raises(CheckpointMismatchError) as err:
        plan(checkpoint, tree, mesh_2x4)
    kinds = [(p.kind, p.hf_key) for p in err.value.problems]
    assert ("missing", "layers.3.w") in kinds  # 4 layers asked, 3 stored
    assert ("missing", None) in kinds  # no rule for "nothing"
    assert sum(k == "shape" for k, _ in kinds) == 6  # every expert of every layer is 5, not 6


def test_only_missing_raises_missing_error(checkpoint, mesh_2x4):
    with pytest.raises(MissingTensorError, match="layers.5.w"):
        plan(checkpoint, {"layers": {"w": (6, 4, 2, 3)}}, mesh_2x4)


def test_shape_mismatch_through_hooks(checkpoint, mesh_2x4):
    with pytest.raises(ShapeMismatchError, match=r"expected \(4, 3, 2\)"):
        plan(checkpoint, {"layers": {"w": (3, 4, 3, 2)}}, mesh_2x4)


def test_strict_reports_unused(checkpoint, mesh_2x4):
    with pytest.raises(UnexpectedTensorError, match="embed.weight"):
        plan(checkpoint, {"layers": {"w": (3, 4, 2, 3), "experts": (3, 2, 5)}}, mesh_2x4, strict=True)


def test_strided_groups_read_every_period_th_layer_and_say_which(tmp_path, mesh_2x4):
    """Seven layers in blocks of three (two local, one global) plus a remainder: each group's stack
    index maps to HF layers by Stride, the remainder too, and describe() names the layers held."""
    rng = np.random.default_rng(0)
    tensors = {f"model.layers.{i}.norm.weight": rng.standard_normal(4).astype(np.float32) for i in range(7)}
    path = write_checkpoint(tmp_path / "ckpt", tensors, config={"model_type": "synthetic", "period": 3})
    table = MappingTable((
        Rule("global.norm", "model.layers.{layer}.norm.weight", indices={"layer": Stride("period", "period - 1")}),
        Rule("local0.norm", "model.layers.{layer}.norm.weight", indices={"layer": Stride("period")}),
        Rule("local1.norm", "model.layers.{layer}.norm.weight", indices={"layer": Stride("period", 1)}),
    ))
    tree = {name: jax.ShapeDtypeStruct((n, 4), np.float32) for name, n in (("global", 2), ("local0", 3), ("local1", 2))}
    leaves, _ = abstract_from_pytree({k: {"norm": v} for k, v in tree.items()}, mesh_2x4)
    with contextlib.closing(LocalSource(path)) as source:
        plan = build_plan(open_index(source), leaves, table, {"period": 3})
    held = {p: plan.leaves[p].describe()["stack_values"]["layer"] for p in plan.leaves}
    assert held == {"global.norm": [2, 5], "local0.norm": [0, 3, 6], "local1.norm": [1, 4]}
    assert [s.name for s in plan.leaves["global.norm"].sources] == ["model.layers.2.norm.weight",
                                                                    "model.layers.5.norm.weight"]
    assert plan.unused == []
