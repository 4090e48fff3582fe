"""Export of native (Orbax) checkpoints: HF → otfload → native checkpoint → HF is bit-exact, leaf by
leaf, honouring the saved ``scan_layers``; ``otfload export NATIVE_DIR OUT`` runs it."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import ml_dtypes
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import otfload
from otfload.checkpoint import CheckpointConfig, LayoutMetadata, MissingLayoutMetadataWarning, OrbaxCheckpointManager
from otfload.checkpoint.paths import flatten_tree
from otfload.cli import main
from otfload.errors import MappingError, NativeCheckpointError, ScanLayersMismatchError
from otfload.export import export_native, is_native_checkpoint
from tests.export.test_export import assert_bit_exact, read_tensors, weight_map_keys

LAYOUTS = {"scanned": True, "unscanned": False}


def params_of(src: Path, mesh, scan: bool) -> dict:
    model = otfload.from_pretrained(src, mesh=mesh, scan_layers=scan)
    return nnx.to_pure_dict(nnx.state(model, nnx.Param))


@pytest.fixture(scope="module")
def native(tiny_checkpoints, mesh_2x4, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama saved as a native checkpoint (step 3) in each layout, with its metadata."""
    src, _ = tiny_checkpoints("llama")
    hf_config = json.loads((src / "config.json").read_text())
    dirs = {}
    for name, scan in LAYOUTS.items():
        dirs[name] = tmp_path_factory.mktemp(f"native-{name}")
        meta = LayoutMetadata(scan_layers=scan, family="llama", model_type="llama", hf_config=hf_config)
        with OrbaxCheckpointManager(CheckpointConfig(dirs[name])) as manager:
            manager.save(3, params_of(src, mesh_2x4, scan), metadata=meta, wait=True)
    return dirs


@pytest.mark.parametrize("name", LAYOUTS)
def test_native_export_is_bit_exact_and_restores_one_leaf_at_a_time(tiny_checkpoints, native, tmp_path, name,
                                                                     monkeypatch):  # fmt: skip
    src, _ = tiny_checkpoints("llama")
    restored, real = [], OrbaxCheckpointManager.restore_leaves

    def spy(self, step, tree, **kw):
        restored.append(sorted(flatten_tree(tree)))
        return real(self, step, tree, **kw)

    monkeypatch.setattr(OrbaxCheckpointManager, "restore_leaves", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error", MissingLayoutMetadataWarning)  # the metadata is there: no warning
        out = export_native(native[name], tmp_path / "out", max_shard_size="60KB")
    assert_bit_exact(read_tensors(out), read_tensors(src))
    assert weight_map_keys(out) == weight_map_keys(src)
    assert json.loads((out / "config.json").read_text()) == json.loads((src / "config.json").read_text())
    with OrbaxCheckpointManager(CheckpointConfig(native[name])) as manager:
        leaves = sorted(manager.leaf_specs(3))
    assert all(len(r) == 1 for r in restored) and sorted(p for r in restored for p in r) == leaves  # each once


def test_scan_layers_is_adopted_checked_and_a_mismatch_is_a_typed_error(tiny_checkpoints, native, tmp_path):
    src, _ = tiny_checkpoints("llama")
    out = export_native(native["unscanned"], tmp_path / "match", scan_layers=False, dtype="bf16")
    want = {k: v.astype(ml_dtypes.bfloat16) for k, v in read_tensors(src).items()}
    assert_bit_exact(read_tensors(out), want)
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    for name, wrong in (("scanned", False), ("unscanned", True)):
        expected = f"scan_layers={wrong} was requested.*scan_layers={not wrong}"
        with pytest.raises(ScanLayersMismatchError, match=expected):
            export_native(native[name], tmp_path / "mismatch", scan_layers=wrong)
    assert not (tmp_path / "mismatch").exists()
    with pytest.raises(NativeCheckpointError, match="not a native checkpoint"):
        export_native(tmp_path / "missing", tmp_path / "out")
    assert not (tmp_path / "missing").exists()


def test_checkpoint_without_metadata_needs_a_config_and_warns(tiny_checkpoints, mesh_2x4, tmp_path):
    src, _ = tiny_checkpoints("llama")
    plain = ocp.CheckpointManager(tmp_path / "foreign", item_names=("state",))  # no otfload metadata
    plain.save(1, args=ocp.args.Composite(state=ocp.args.StandardSave(params_of(src, mesh_2x4, True))))
    plain.wait_until_finished()
    plain.close()
    with pytest.warns(MissingLayoutMetadataWarning), pytest.raises(MappingError, match="no HF config"):
        export_native(tmp_path / "foreign", tmp_path / "out")
    with pytest.warns(MissingLayoutMetadataWarning, match="assuming scan_layers=True"):
        out = export_native(tmp_path / "foreign", tmp_path / "out", config=src / "config.json")
    assert_bit_exact(read_tensors(out), read_tensors(src))
    with pytest.warns(MissingLayoutMetadataWarning), pytest.raises(ScanLayersMismatchError, match="are scanned"):
        export_native(tmp_path / "foreign", tmp_path / "other", config=src, scan_layers=False)


def test_cli_exports_a_native_checkpoint(tiny_checkpoints, native, tmp_path, capsys):
    src, _ = tiny_checkpoints("llama")
    assert is_native_checkpoint(native["scanned"]) and not is_native_checkpoint(src)
    assert not is_native_checkpoint(tmp_path)  # empty directory
    out = tmp_path / "out"
    assert main(["export", str(native["scanned"]), str(out), "--max-shard-size", "60KB", "--step", "3"]) == 0
    assert f"exported {native['scanned']} to {out}" in capsys.readouterr().out
    assert_bit_exact(read_tensors(out), read_tensors(src))
    assert weight_map_keys(out) == weight_map_keys(src)
    assert main(["export", str(native["scanned"]), str(tmp_path / "bad"), "--no-scan-layers"]) == 1
    assert "ScanLayersMismatchError" in capsys.readouterr().err
    assert main(["export", str(native["scanned"]), str(tmp_path / "bad"), "--step", "9"]) == 1
    assert "no step 9" in capsys.readouterr().err
