import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from otfload.checkpoint import (
    CheckpointConfig,
    LayoutMetadata,
    MissingLayoutMetadataWarning,
    OrbaxCheckpointManager,
    reshard_checkpoint,
)
from otfload.checkpoint.paths import flatten_tree, unflatten_tree
from otfload.checkpoint.resave import _parts, fallback_spec, target_sharding
from otfload.errors import NativeCheckpointError, ScanLayersMismatchError
from otfload.plan.sharding import DEFAULT_RULES, make_mesh, parse_mesh_spec

from .helpers import assert_trees_equal, scanned_state

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
    """The on-disk chunk shape of every array: Orbax writes one chunk per device shard."""
    plain = ocp.CheckpointManager(
        directory, item_names=("state",), item_handlers={"state": ocp.PyTreeCheckpointHandler()}
    )
    tree = plain.item_metadata(step)["state"].tree
    return {k: tuple(v.storage.chunk_shape) for k, v in flatten_tree(tree).items()}


def _targets(state, layout, mesh):
    """``state``'s abstract tree with the shardings reshard picks for ``mesh``."""
    flat = flatten_tree(state)
    shardings = {
        path: target_sharding(path, x.shape, layout, mesh, DEFAULT_RULES) for path, x in flat.items()
    }
    return unflatten_tree(
        {p: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=shardings[p]) for p, x in flat.items()}
    )


def test_reshard_is_bit_exact_keeps_metadata_and_rewrites_chunks(tmp_path, mesh):
    state = scanned_state(mesh)
    saved_meta = _save(tmp_path / "src", {1: state})
    step = reshard_checkpoint(
        tmp_path / "src", tmp_path / "dst", parse_mesh_spec("fsdp=8"), max_part_bytes=600
    )
    assert step == 1
    with _open(tmp_path / "dst") as dst:
        assert dst.all_steps() == [1]
        assert dst.metadata(1) == saved_meta.replace(mesh_axes={"fsdp": 8})
        restored = dst.restore(1, _targets(state, META, make_mesh({"fsdp": 8})))
    for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert _chunk_shapes(tmp_path / "dst", 1) == {
        "model.embed.embedding": (16, 1),  # logical axes ("vocab", "embed"): embed -> fsdp
        "model.layers.attn.kernel": (3, 8, 2),  # fallback: largest divisible dim on fsdp
        "model.layers.norm.scale": (3, 1),
    }


def test_reshard_onto_2x4_from_another_layout_and_step(tmp_path, mesh):
    layout = LayoutMetadata(logical_axes={"w": ("embed", "mlp")})  # rules: embed -> fsdp, mlp -> tp
    fsdp8 = make_mesh({"fsdp": 8})
    w = jax.device_put(np.arange(64 * 8, dtype=np.float32).reshape(64, 8), NamedSharding(fsdp8, P("fsdp")))
    _save(tmp_path / "src", {1: {"w": w}, 2: {"w": w + 1}}, meta=layout)
    assert _chunk_shapes(tmp_path / "src", 1) == {"w": (8, 8)}
    reshard_checkpoint(tmp_path / "src", tmp_path / "dst", {"fsdp": 2, "tp": 4}, step=1)
    expected = {"w": jax.device_put(w, NamedSharding(mesh, P("fsdp", "tp")))}
    with _open(tmp_path / "dst") as dst:
        assert dst.all_steps() == [1]
        saved = layout.replace(scan_layers=False, param_dtype="float32")  # filled in at save time
        assert dst.metadata() == saved.replace(mesh_axes={"fsdp": 2, "tp": 4})
        assert_trees_equal(dst.restore(1, _targets(expected, layout, mesh)), expected)
    assert _chunk_shapes(tmp_path / "dst", 1) == {"w": (32, 2)}


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
        reshard_checkpoint(
            tmp_path / "src", tmp_path / "dst", {"fsdp": 8}, scan_layers=True, max_part_bytes=1
        )
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
    [((3, 5), P()), ((4, 6), P(None, "fsdp")), ((6, 6), P("fsdp")), ((), P())],
)
def test_fallback_shards_largest_divisible_dim_on_first_axis(shape, spec):
    assert fallback_spec(shape, make_mesh({"fsdp": 2, "tp": 4})) == spec


def test_parts_stay_within_the_byte_budget():
    leaves = {f"l{i}": jax.ShapeDtypeStruct((n,), np.float32) for i, n in enumerate([10, 10, 30, 5, 5])}
    sizes = [[4 * v.shape[0] for v in flatten_tree(part).values()] for part in _parts(leaves, max_bytes=80)]
    assert sizes == [[40, 40], [120], [20, 20]]
