import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import PartitionSpec

from otfload.checkpoint import (
    CheckpointConfig,
    LayoutMetadata,
    MissingLayoutMetadataWarning,
    OrbaxCheckpointManager,
    reshard_checkpoint,
)
from otfload.checkpoint.paths import flatten_tree
from otfload.checkpoint.reshard import _parts, fallback_spec
from otfload.errors import NativeCheckpointError, ScanLayersMismatchError
from otfload.plan.sharding import make_mesh, parse_mesh_spec

from .helpers import abstract, assert_trees_equal, scanned_state

META = LayoutMetadata(
    family="llama",
    model_type="llama",
    hf_config={"num_hidden_layers": 3, "hidden_size": 8},
    logical_axes={"model.embed.embedding": ("vocab", "embed")},
)


def _save(directory, states: dict, meta=META):
    with OrbaxCheckpointManager(CheckpointConfig(directory, max_to_keep=None)) as manager:
        for step, state in states.items():
            manager.save(step, state, metadata=meta, wait=True)
        return manager.metadata()


def _open(directory):
    return OrbaxCheckpointManager(CheckpointConfig(directory))


def _chunk_shapes(directory, step):
    plain = ocp.CheckpointManager(directory, item_names=("state",))
    tree = plain.item_metadata(step)["state"].tree
    return {k: tuple(v.storage.chunk_shape) for k, v in flatten_tree(tree).items()}


def test_reshard_is_bit_exact_keeps_metadata_and_rewrites_chunks(tmp_path, mesh):
    state = scanned_state(mesh)
    saved_meta = _save(tmp_path / "src", {1: state})
    step = reshard_checkpoint(tmp_path / "src", tmp_path / "dst", parse_mesh_spec("fsdp=8"), max_part_bytes=600)
    assert step == 1
    with _open(tmp_path / "dst") as dst:
        assert dst.all_steps() == [1]
        assert dst.metadata(1) == saved_meta.replace(mesh_axes={"fsdp": 8})
        target = make_mesh({"fsdp": 8})
        restored = dst.restore(1, abstract(jax.tree.map(lambda x: jax.device_put(x, _on(target, x)), state)))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert _chunk_shapes(tmp_path / "dst", 1) == {
        "model.embed.embedding": (16, 1),  # logical axes ("vocab", "embed"): embed -> fsdp
        "model.layers.attn.kernel": (3, 8, 2),  # fallback: largest divisible dim on fsdp
        "model.layers.norm.scale": (3, 1),
    }


def _on(mesh, leaf):
    from otfload.checkpoint.reshard import target_sharding

    return target_sharding(_path_of(leaf), leaf.shape, META, mesh, ())


def _path_of(leaf):
    return {(16, 8): "model.embed.embedding"}.get(leaf.shape, "other")


def test_reshard_back_onto_2x4_restores_identical_shardings(tmp_path, mesh):
    state = scanned_state(mesh)
    fsdp8 = make_mesh({"fsdp": 8})
    on_fsdp8 = jax.tree.map(lambda x: jax.device_put(x, jax.sharding.NamedSharding(fsdp8, PartitionSpec("fsdp"))),
                            {"w": np.arange(64 * 8, dtype=np.float32).reshape(64, 8)})  # fmt: skip
    _save(tmp_path / "src", {1: on_fsdp8, 2: {"w": on_fsdp8["w"] + 1}}, meta=LayoutMetadata())
    reshard_checkpoint(tmp_path / "src", tmp_path / "dst", {"fsdp": 2, "tp": 4}, step=1)
    with _open(tmp_path / "dst") as dst:
        assert dst.all_steps() == [1]
        target = abstract(jax.tree.map(lambda x: jax.device_put(x, _first_axis(mesh)), on_fsdp8))
        assert_trees_equal(dst.restore(1, target), jax.tree.map(lambda x: jax.device_put(x, _first_axis(mesh)), on_fsdp8))
        assert dst.metadata().mesh_axes == {"fsdp": 2, "tp": 4}
    assert _chunk_shapes(tmp_path / "dst", 1) == {"w": (32, 8)}
    del state


def _first_axis(mesh):
    return jax.sharding.NamedSharding(mesh, PartitionSpec("fsdp"))


def test_reshard_applies_the_scan_layers_rule(tmp_path, mesh):
    _save(tmp_path / "src", {1: scanned_state(mesh)})
    with pytest.raises(ScanLayersMismatchError, match="saved with scan_layers=True"):
        reshard_checkpoint(tmp_path / "src", tmp_path / "dst", {"fsdp": 8}, scan_layers=False)
    with _open(tmp_path / "dst") as dst:
        assert not dst.has_checkpoint()
    reshard_checkpoint(tmp_path / "src", tmp_path / "dst", {"fsdp": 8}, scan_layers=True)
    with _open(tmp_path / "dst") as dst:
        assert dst.metadata().scan_layers is True


def test_reshard_without_metadata_warns_once_and_records_callers_value(tmp_path, mesh):
    state = scanned_state(mesh)
    plain = ocp.CheckpointManager(tmp_path / "src", item_names=("state",))
    plain.save(3, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    plain.wait_until_finished()
    plain.close()
    with pytest.warns(MissingLayoutMetadataWarning) as record:
        reshard_checkpoint(tmp_path / "src", tmp_path / "dst", {"fsdp": 8}, scan_layers=True, max_part_bytes=1)
    assert len(record) == 1
    with _open(tmp_path / "dst") as dst:
        assert dst.metadata(3).scan_layers is True and dst.metadata(3).mesh_axes == {"fsdp": 8}


def test_reshard_refuses_to_overwrite_an_existing_step(tmp_path, mesh):
    _save(tmp_path / "src", {1: scanned_state(mesh)})
    reshard_checkpoint(tmp_path / "src", tmp_path / "dst", {"fsdp": 8})
    with pytest.raises(NativeCheckpointError, match="step 1 already exists"):
        reshard_checkpoint(tmp_path / "src", tmp_path / "dst", {"fsdp": 8})


@pytest.mark.parametrize(
    ("shape", "spec"),
    [((3, 5), PartitionSpec()), ((4, 6), PartitionSpec(None, "fsdp")), ((6, 6), PartitionSpec("fsdp")), ((), PartitionSpec())],
)
def test_fallback_shards_largest_divisible_dim_on_first_axis(shape, spec):
    assert fallback_spec(shape, make_mesh({"fsdp": 2, "tp": 4})) == spec


def test_parts_stay_within_the_byte_budget():
    leaves = {f"l{i}": jax.ShapeDtypeStruct((n,), np.float32) for i, n in enumerate([10, 10, 30, 5, 5])}
    sizes = [[4 * v.shape[0] for v in flatten_tree(part).values()] for part in _parts(leaves, max_bytes=80)]
    assert sizes == [[40, 40], [120], [20, 20]]
