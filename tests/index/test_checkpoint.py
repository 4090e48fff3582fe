"""Hostile checkpoint indexes: every bad ``weight_map`` or config is refused before any tensor byte is read."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from otfload.errors import CheckpointIndexError, SourceNotFoundError, UnsafeFormatError
from otfload.index.checkpoint import CONFIG_FILE, INDEX_FILE, open_index
from otfload.index.header import HEADER_PREFETCH_BYTES
from otfload.sources import LocalSource, open_source
from tests.index.support import RecordingSource
from tests.synthetic import write_checkpoint

SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
# Each shard is larger than the header prefetch, so a read of tensor data would show past it.
BIG = HEADER_PREFETCH_BYTES // 4 + 1000


def _write_checkpoint(root: Path) -> Path:
    safetensors.numpy.save_file({"a": np.ones(BIG, np.float32), "b": np.zeros(3, np.int8)}, root / SHARD1)
    safetensors.numpy.save_file({"c": np.full(BIG, 2.0, np.float32)}, root / SHARD2)
    (root / CONFIG_FILE).write_text(json.dumps({"model_type": "llama"}))
    _write_index(root, {"a": SHARD1, "b": SHARD1, "c": SHARD2})
    return root


def _write_index(root: Path, weight_map: object, **extra) -> None:
    (root / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map, **extra}))


@pytest.fixture
def checkpoint(tmp_path: Path) -> Path:
    return _write_checkpoint(tmp_path)


def _header_end(path: Path) -> int:
    return 8 + struct.unpack("<Q", path.read_bytes()[:8])[0]


@pytest.fixture
def open_recorded(closing):
    """``open_recorded(root) -> (source, error)``: ``open_index`` on a recording source, closed after the test."""

    def _open(root: Path) -> tuple[RecordingSource, Exception | None]:
        source = closing(RecordingSource(LocalSource(root)))
        try:
            open_index(source)
        except Exception as e:  # noqa: BLE001 - returned for the test to check its type
            return source, e
        return source, None

    return _open


def _assert_no_tensor_bytes_read(source: RecordingSource, root: Path) -> None:
    """Shards were read only within the header (or its speculative prefetch), JSON files anywhere."""
    assert not source.out_of_bounds()
    for file, offset, length in source.reads:
        if file.endswith(".safetensors"):
            assert offset + length <= max(_header_end(root / file), HEADER_PREFETCH_BYTES), (file, offset, length)


def test_valid_checkpoint_reads_headers_only(closing, checkpoint: Path):
    source = closing(RecordingSource(LocalSource(checkpoint)))
    index = open_index(source)
    assert {k: t.file for k, t in index.tensors.items()} == {"a": SHARD1, "b": SHARD1, "c": SHARD2}
    assert index.config == {"model_type": "llama"}
    _assert_no_tensor_bytes_read(source, checkpoint)


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("../x.safetensors", "outside the checkpoint"),
        ("sub/../../x.safetensors", "outside the checkpoint"),
        ("/etc/passwd", "outside the checkpoint"),
        ("http://example.com/x.safetensors", "outside the checkpoint"),
        ("C:\\x.safetensors", "outside the checkpoint"),
        ("\\\\server\\share\\x.safetensors", "outside the checkpoint"),
        ("missing.safetensors", "missing file"),
        ("", "not a string"),
        (7, "not a string"),
        (None, "not a string"),
    ],
)
def test_bad_weight_map_targets_are_refused_before_any_shard_is_read(
    open_recorded, checkpoint: Path, target: object, message: str
):
    _write_index(checkpoint, {"a": SHARD1, "b": target, "c": SHARD2})
    source, error = open_recorded(checkpoint)
    assert isinstance(error, CheckpointIndexError) and message in str(error), error
    assert source.read_files() == {CONFIG_FILE, INDEX_FILE}


@pytest.mark.parametrize(
    ("index_text", "message"),
    [
        (f'{{"weight_map": {{"a": "{SHARD1}", "a": "{SHARD2}"}}}}', "duplicate key 'a'"),
        (f'{{"weight_map": {{"a": "{SHARD1}", "b": "{SHARD1}"', "not valid JSON"),
        ("\xff\xfe", "not valid JSON"),
        ('{"weight_map": []}', "no 'weight_map' object"),
        ('{"weight_map": "model.safetensors"}', "no 'weight_map' object"),
        ('{"metadata": {}}', "no 'weight_map' object"),
        ("[]", "no 'weight_map' object"),
        ('{"weight_map": {}}', "'weight_map' is empty"),
        ('{"weight_map": ' + "[" * 100_000 + "]" * 100_000 + "}", "not valid JSON"),
    ],
    ids=["one-tensor-two-files", "truncated", "not-utf8", "list", "string", "missing", "not-object", "empty", "deep"],
)
def test_malformed_index_is_refused_before_any_shard_is_read(
    open_recorded, checkpoint: Path, index_text: str, message: str
):
    (checkpoint / INDEX_FILE).write_bytes(index_text.encode("latin-1"))
    source, error = open_recorded(checkpoint)
    assert isinstance(error, CheckpointIndexError) and message in str(error), error
    assert source.read_files() <= {CONFIG_FILE, INDEX_FILE}


@pytest.mark.parametrize(
    "weight_map",
    [{"a": SHARD1, "b": SHARD1, "c": SHARD2, "d": SHARD2}, {"a": SHARD2, "b": SHARD1, "c": SHARD2}],
    ids=["absent-everywhere", "in-another-shard"],
)
def test_tensor_missing_from_its_named_shard_is_found_from_headers_alone(
    open_recorded, checkpoint: Path, weight_map: dict
):
    _write_index(checkpoint, weight_map)
    source, error = open_recorded(checkpoint)
    assert isinstance(error, CheckpointIndexError) and "is not in model-0000" in str(error), error
    _assert_no_tensor_bytes_read(source, checkpoint)


@pytest.mark.parametrize(
    ("config", "message"),
    [(None, f"no {CONFIG_FILE}"), ("[1, 2]", "not a JSON object"), ('{"model_type": ', "not valid JSON")],
    ids=["missing", "not-object", "invalid"],
)
def test_bad_config_is_refused_before_any_shard_is_read(
    open_recorded, checkpoint: Path, config: str | None, message: str
):
    if config is None:
        (checkpoint / CONFIG_FILE).unlink()
    else:
        (checkpoint / CONFIG_FILE).write_text(config)
    source, error = open_recorded(checkpoint)
    assert isinstance(error, CheckpointIndexError) and message in str(error), error
    assert not any(f.endswith(".safetensors") for f in source.read_files())


def test_shard_symlinked_outside_the_directory_is_refused(open_recorded, checkpoint: Path, tmp_path_factory):
    outside = tmp_path_factory.mktemp("outside") / "stolen.safetensors"
    (checkpoint / SHARD2).rename(outside)
    (checkpoint / SHARD2).symlink_to(outside)
    source, error = open_recorded(checkpoint)
    assert isinstance(error, SourceNotFoundError) and "outside" in str(error), error
    assert SHARD2 not in source.read_files()


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "model.ckpt"])
def test_pickle_only_checkpoint_is_refused(tmp_path: Path, name: str):
    (tmp_path / name).write_bytes(b"\x80\x04 not unpickled")
    (tmp_path / CONFIG_FILE).write_text("{}")
    with pytest.raises(UnsafeFormatError, match="safetensors"):
        open_source(tmp_path)


def test_weight_map_pointing_at_a_non_safetensors_file_is_refused(closing, tmp_path):
    path = write_checkpoint(tmp_path / "c", {"w": np.ones(2, np.float32)}, files=1)
    index = json.loads((path / INDEX_FILE).read_text())
    index["weight_map"]["w"] = CONFIG_FILE
    (path / INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(CheckpointIndexError, match="not a .safetensors file"):
        open_index(closing(LocalSource(path)))
