"""The one member-name check: every hostile name is a typed error naming it, plain names pass, and
the index refuses a hostile listing from a real server before reading a byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from otfload.errors import CacheUnsafeNameError, CheckpointIndexError
from otfload.index.checkpoint import open_index
from otfload.sources import LocalSource
from otfload.sources.fsspec_source import FsspecSource
from otfload.sources.names import MAX_NAME_BYTES, MAX_SEGMENT_BYTES, check_member_name, checked_listing
from tests.servers.gcs_server import GcsServer

HOSTILE = [
    (None, "not a string"),
    (7, "not a string"),
    (b"model.safetensors", "not a string"),
    ("", "not a string"),
    ("../x.safetensors", "a '..' segment"),
    ("a/../../x.safetensors", "a '..' segment"),
    ("a/..", "a '..' segment"),
    ("/etc/passwd", "an absolute path"),
    ("//server/share/x.json", "an absolute path"),
    ("\\\\server\\share\\x.json", "a backslash"),
    ("a\\..\\x.json", "a backslash"),
    ("C:x.json", "a drive letter"),
    ("c:/x.json", "a drive letter"),
    ("http://example.com/x.safetensors", "a URL"),
    ("a/gs://b/x.json", "a URL"),
    ("x\x00.json", "control character"),
    ("x\n.json", "control character"),
    ("x\x1b[31m.json", "control character"),
    ("x\x7f.json", "control character"),
    ("x\x85.json", "control character"),
    ("x\u2028.json", "control character"),
    ("x\ud800.json", "not valid UTF-8"),
    ("a//b.json", "not a plain name"),
    ("./a.json", "not a plain name"),
    ("a/./b.json", "not a plain name"),
    ("a/", "not a plain name"),
    ("a/" * (MAX_NAME_BYTES // 2) + "x.json", "bytes long"),
    ("é" * (MAX_SEGMENT_BYTES // 2 + 1) + ".json", f"longer than {MAX_SEGMENT_BYTES}"),
]
PLAIN = ["config.json", "model-00001-of-00163.safetensors", "sub/dir/x.safetensors", "a..b.json", "..a.json",
         "é.json", "C.json", "name:with:colons.json", "x" * MAX_SEGMENT_BYTES]  # fmt: skip


@pytest.mark.parametrize(("name", "why"), HOSTILE, ids=[repr(n)[:30] for n, _ in HOSTILE])
@pytest.mark.parametrize("error", [CheckpointIndexError, CacheUnsafeNameError])
def test_a_hostile_name_is_the_callers_typed_error_naming_it(name: object, why: str, error: type):
    with pytest.raises(error) as info:
        check_member_name(name, "somewhere", error)
    assert why in str(info.value) and str(info.value).startswith("somewhere: ")
    assert repr(name)[:40] in str(info.value)


@pytest.mark.parametrize("name", PLAIN)
def test_plain_names_pass_unchanged(name: str):
    assert check_member_name(name, "somewhere") == name


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["a.json", 3], "3 is not a string"),
        (["a.json", None], "None is not a string"),
        (["a.json", "b\x00.json"], "control character"),
        (["a.json", "b.json", "a.json"], "'a.json' is listed twice"),
        (["a.safetensors", "a.safetensors/b.safetensors"], "'a.safetensors' is listed both as a file and as a folder"),
        (["x/y", "x/y/z/w.json", "q.json"], "'x/y' is listed both as a file and as a folder"),
    ],
)
def test_a_bad_listing_is_a_typed_error_naming_the_name(names: list, message: str):
    with pytest.raises(CheckpointIndexError, match=message.replace("(", r"\(")):
        checked_listing(names, "src")


def test_a_listing_is_sorted_and_keep_limits_the_check_to_the_files_read():
    assert checked_listing(["b.json", "a/c.json", "a/d.json"], "src") == ["a/c.json", "a/d.json", "b.json"]
    keep = lambda n: n.endswith(".json")  # noqa: E731
    assert checked_listing(["x.json", "notes\x01.txt"], "src", keep=keep) == ["x.json"]
    with pytest.raises(CheckpointIndexError, match="not a string"):
        checked_listing(["x.json", 5], "src", keep=keep)  # never skipped: keep cannot even look at it


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"../../x.safetensors": b"x"}, "'../../x.safetensors' is outside the checkpoint"),
        ({"ctl\x01.json": b"{}"}, "control character"),
        ({"model-00001-of-00002.safetensors/b.safetensors": b"x"}, "both as a file and as a folder"),
    ],
)
def test_open_index_refuses_a_hostile_listing_from_a_real_server_before_reading(
    extra: dict, message: str, checkpoint: Path, gcs_server: GcsServer
):
    fs = gcs_server.filesystem()
    prefix = f"otfload-names/{abs(hash(tuple(extra)))}"
    if not fs.exists("otfload-names"):
        fs.mkdir("otfload-names")
    for path in checkpoint.iterdir():
        fs.pipe_file(f"{prefix}/{path.name}", path.read_bytes())
    for name, data in extra.items():
        fs.pipe_file(f"{prefix}/{name}", data)
    fs.invalidate_cache()
    source = FsspecSource(f"gs://{prefix}", gcs_server.storage_options)
    with pytest.raises(CheckpointIndexError, match=message.replace("(", r"\(")):
        open_index(source)


def test_open_index_ignores_stray_files_it_never_reads(checkpoint: Path, tmp_path: Path):
    root = shutil.copytree(checkpoint, tmp_path / "ckpt")
    (root / "Icon\r").write_bytes(b"")  # what macOS leaves in folders: not a checkpoint file
    index = open_index(LocalSource(root))
    assert index.files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
