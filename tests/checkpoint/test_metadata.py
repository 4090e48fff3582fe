import warnings

import jax
import orbax.checkpoint as ocp
import pytest

from otfload.checkpoint import (
    CheckpointConfig,
    LayoutMetadata,
    MissingLayoutMetadataWarning,
    OrbaxCheckpointManager,
    resolve_checkpoint_scan_layers,
    resolve_scan_layers,
)
from otfload.errors import NativeCheckpointError, ScanLayersMismatchError

from .helpers import abstract, assert_trees_equal, scanned_state, unscanned_state


@pytest.mark.parametrize(
    ("requested", "saved", "expected"),
    [(None, True, True), (None, False, False), (True, True, True), (False, False, False)],
    ids=["implicit-adopts-true", "implicit-adopts-false", "explicit-match-true", "explicit-match-false"],
)
def test_resolve_adopts_or_confirms_the_saved_value(requested, saved, expected):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no warning when metadata exists
        assert resolve_scan_layers(requested, saved) is expected


@pytest.mark.parametrize(("requested", "saved"), [(True, False), (False, True)])
def test_resolve_explicit_mismatch_names_both_values(requested, saved):
    with pytest.raises(ScanLayersMismatchError) as info:
        resolve_scan_layers(requested, saved, source="ckpt/7")
    message = str(info.value)
    assert f"scan_layers={requested} was requested" in message
    assert f"ckpt/7 was saved with scan_layers={saved}" in message


@pytest.mark.parametrize(("requested", "expected"), [(True, True), (False, False), (None, False)])
def test_resolve_without_metadata_uses_callers_value_and_warns(requested, expected):
    with pytest.warns(MissingLayoutMetadataWarning, match=f"assuming scan_layers={expected}") as record:
        assert resolve_scan_layers(requested, None) is expected
    assert len(record) == 1


def _saved(tmp_path, state, **meta):
    manager = OrbaxCheckpointManager(CheckpointConfig(tmp_path))
    manager.save(1, state, metadata=LayoutMetadata(**meta), wait=True)
    return manager


@pytest.mark.parametrize("scanned", [True, False])
def test_checkpoint_implicit_request_adopts_recorded_layout(tmp_path, mesh, scanned):
    state = scanned_state(mesh) if scanned else unscanned_state(mesh)
    with _saved(tmp_path, state) as manager:
        assert manager.metadata(1).scan_layers is scanned  # detected from the tree at save time
        assert resolve_checkpoint_scan_layers(manager, None) is scanned
        assert resolve_checkpoint_scan_layers(manager, scanned, step=1) is scanned
        with pytest.raises(ScanLayersMismatchError):
            resolve_checkpoint_scan_layers(manager, not scanned)


def test_restore_with_layout_conflicting_with_metadata_raises(tmp_path, mesh):
    with _saved(tmp_path, scanned_state(mesh)) as manager:
        with pytest.raises(ScanLayersMismatchError, match="saved with scan_layers=True"):
            manager.restore(1, abstract(unscanned_state(mesh)))
        with pytest.raises(ScanLayersMismatchError):
            manager.restore(1, abstract(scanned_state(mesh)), scan_layers=False)


def test_restore_of_checkpoint_without_metadata_warns_once(tmp_path, mesh):
    state = scanned_state(mesh)
    plain = ocp.CheckpointManager(tmp_path, item_names=("state",))  # a foreign Orbax checkpoint
    plain.save(4, args=ocp.args.Composite(state=ocp.args.StandardSave(state)))
    plain.wait_until_finished()
    plain.close()
    with OrbaxCheckpointManager(CheckpointConfig(tmp_path)) as manager:
        assert manager.metadata(4) is None
        with pytest.warns(MissingLayoutMetadataWarning) as record:
            restored = manager.restore(4, abstract(state))
        assert len(record) == 1
        assert_trees_equal(restored, state)


def test_metadata_json_round_trip_and_forward_compatibility():
    meta = LayoutMetadata(
        scan_layers=True,
        family="qwen3",
        model_type="qwen3",
        hf_config={"hidden_size": 8, "rope_scaling": None},
        param_dtype="bfloat16",
        mesh_axes={"fsdp": 4, "tp": 2},
        logical_axes={"model.embed.embedding": ("vocab", "embed"), "model.norm": (None,)},
    )
    assert LayoutMetadata.from_json(meta.to_json()) == meta
    assert LayoutMetadata.from_json({**meta.to_json(), "added_later": 1}) == meta
    with pytest.raises(NativeCheckpointError, match="scan_layers='yes'"):
        LayoutMetadata.from_json({"scan_layers": "yes"})
    with pytest.raises(NativeCheckpointError, match="JSON object"):
        LayoutMetadata.from_json(["scan_layers"])


def test_completed_for_fills_only_unset_fields(mesh):
    state = scanned_state(mesh)
    filled = LayoutMetadata(model_type="llama").completed_for(state)
    assert (filled.scan_layers, filled.param_dtype, filled.mesh_axes) == (
        True,
        "float32",
        {"fsdp": 2, "tp": 4},
    )
    kept = LayoutMetadata(scan_layers=False, param_dtype="bfloat16", mesh_axes={"x": 8}).completed_for(state)
    assert (kept.scan_layers, kept.param_dtype, kept.mesh_axes) == (False, "bfloat16", {"x": 8})
    host = LayoutMetadata().completed_for(jax.tree.map(lambda x: x.astype("bfloat16"), {"w": state["model"]}))
    assert host.param_dtype == "bfloat16"
