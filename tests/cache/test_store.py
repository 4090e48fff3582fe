"""Cache stores against hostile names, planted symlinks, temporaries of dead writers, and cache
locations that are read-only, full or a file: typed errors, nothing written outside the root."""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from otfload.cache import CacheStorageError, cache_key
from otfload.cache.store import HOST_TAG, FsspecStore, LocalStore, partial_name
from otfload.errors import CacheError, CacheUnsafeNameError
from otfload.sources.fsspec_source import FsspecSource
from tests.cache.conftest import FILES, SHARD, fill, tree
from tests.cache.sandbox import private_mounts_available, run_fills
from tests.servers.gcs_server import GcsServer

# (name a source lists, what the error says). Each is served by the real fake-gcs-server, which
# stores object names as given.
HOSTILE_NAMES = [
    ("../../x.safetensors", "outside the checkpoint ("),
    ("sub/../../../y.safetensors", "a '..' segment"),
    ("/abs.safetensors", "an absolute path"),
    ("C:/z.json", "a drive letter"),
    ("back\\slash.json", "a backslash"),
    ("ctl\x01.json", "control character"),
    ("line\nbreak.json", "control character"),
    ("./dot.json", "not a plain name"),
    ("x" * 300 + ".json", "longer than"),
    ("m.sha256/y.json", "reserved for the shard cache"),
    (".m.safetensors.partial-x/y.json", "reserved for the shard cache"),
]
# A live writer's temporary is never this old; an orphan's idle time is set past it by the test.
OLD_S = 2 * 3600


def _assert_names_it(error: BaseException, name: str) -> None:
    assert repr(name)[:60] in str(error), str(error)


# --- hostile names -----------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "why"), HOSTILE_NAMES, ids=[repr(n)[:24] for n, _ in HOSTILE_NAMES])
def test_a_hostile_listed_name_is_a_typed_error_and_nothing_is_written_anywhere(
    name, why, upload, open_gcs, gcs_server: GcsServer, gs_cache, tmp_path: Path
):
    source = open_gcs(upload({**FILES, name: b"written where the source says"}))
    assert name in source.list_files()  # the real server lists it as given

    local = tmp_path / "deep" / "cache"
    with pytest.raises(CacheUnsafeNameError) as info:
        fill(source, local)
    assert why in str(info.value)
    _assert_names_it(info.value, name)
    assert tree(tmp_path) == {}  # not even the cache directory was made

    prefix, options = gs_cache
    with pytest.raises(CacheUnsafeNameError) as info:
        fill(source, prefix, storage_options=options)
    _assert_names_it(info.value, name)
    fs = gcs_server.filesystem()
    fs.invalidate_cache()
    assert fs.find(prefix.removeprefix("gs://")) == []


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"model.safetensors/b.safetensors": b"x"}, "both as a file and as a folder"),
        ({"sub/extra.json/deeper.json": b"x"}, "both as a file and as a folder"),
    ],
)
def test_names_colliding_as_file_and_folder_are_a_typed_error(extra, message, upload, open_gcs, tmp_path):
    source = open_gcs(upload({**FILES, "model.safetensors": b"m", **extra}))
    with pytest.raises(CacheUnsafeNameError, match=message):
        fill(source, tmp_path / "cache")
    assert tree(tmp_path) == {}


def test_every_store_method_checks_the_name_it_is_given(tmp_path: Path, gs_cache):
    prefix, options = gs_cache
    for store in (LocalStore(tmp_path / "cache", "key"), FsspecStore(prefix, "key", options)):
        for call in (
            lambda s: s.stat("../x.json"),
            lambda s: s.read_record("/etc/passwd"),
            lambda s: s.write_record("a/../../b.json", "{}"),
            lambda s: s.remove("../../x.json"),
            lambda s: s.writer("../x.json").__enter__(),
            lambda s: s.reader("..\\x.json").__enter__(),
            lambda s: s.path("x.json.sha256"),
        ):
            with pytest.raises(CacheUnsafeNameError):
                call(store)
    assert tree(tmp_path) == {"cache": "dir", "cache/key": "dir"}
    with pytest.raises(CacheUnsafeNameError):
        LocalStore(tmp_path / "cache", "../escape")
    assert not (tmp_path / "escape").exists()


# --- symlinks inside the cache -----------------------------------------------------------------------


@pytest.mark.parametrize("planted", ["entry", "record", "folder", "cache folder"])
def test_a_symlink_planted_in_the_cache_is_never_followed(planted, upload, open_gcs, tmp_path: Path):
    url = upload(FILES)
    cache_dir = tmp_path / "cache"
    fill(open_gcs(url), cache_dir)
    folder = cache_dir / cache_key(open_gcs(url))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_bytes(FILES[SHARD])  # same size as the entry: a link to it would look valid
    link, target = {
        "entry": (folder / SHARD, outside / "victim"),
        "record": (folder / f"{SHARD}.sha256", outside / "victim"),
        "folder": (folder / "sub", outside),
        "cache folder": (folder, outside),
    }[planted]
    shutil.rmtree(link) if link.is_dir() else link.unlink()
    link.symlink_to(target)
    before = tree(outside)

    with pytest.raises(CacheUnsafeNameError, match="symbolic link") as info:
        fill(open_gcs(url), cache_dir)
    assert str(link) in str(info.value)
    assert tree(outside) == before  # nothing written, removed or replaced through the link
    assert link.is_symlink()  # and the link itself is left for the user to look at


def test_a_link_to_a_file_inside_the_cache_is_not_trusted_either(upload, open_gcs, tmp_path: Path):
    url = upload(FILES)
    fill(open_gcs(url), tmp_path / "cache")
    folder = tmp_path / "cache" / cache_key(open_gcs(url))
    (folder / "config.json").unlink()
    (folder / "config.json").symlink_to(folder / "sub" / "extra.json")
    with pytest.raises(CacheUnsafeNameError, match="symbolic link"):
        fill(open_gcs(url), tmp_path / "cache")


# --- temporaries of dead writers -------------------------------------------------------------------


def _dead_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def _zombie() -> subprocess.Popen:
    """A child that has exited but is not reaped yet (its pid still exists, as a zombie)."""
    proc = subprocess.Popen(["true"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return proc


def test_temporaries_of_dead_writers_are_removed_and_live_ones_kept(tmp_path: Path):
    store = LocalStore(tmp_path, "key")
    root = tmp_path / "key"
    (root / "sub").mkdir()
    other_host = "0" * 8 if HOST_TAG != "0" * 8 else "1" * 8
    zombie = _zombie()
    try:
        names = {
            "dead pid here": (f".a.safetensors.partial-{HOST_TAG}-{_dead_pid()}-0123456789ab", False),
            "zombie here": (f"sub/.b.json.partial-{HOST_TAG}-{zombie.pid}-0123456789ab", False),
            "live pid here": (partial_name("c.safetensors"), False),
            "other host, fresh": (f".d.safetensors.partial-{other_host}-1-0123456789ab", False),
            "other host, idle": (f".e.safetensors.partial-{other_host}-1-0123456789ab", True),
            "older otfload, idle": (".f.safetensors.partial-" + "ab" * 16, True),
            "older otfload, fresh": (".g.safetensors.partial-" + "cd" * 16, False),
            "not ours, idle": (".h.safetensors.partial-by-someone-else", True),
        }
        for name, idle in names.values():
            (root / name).write_bytes(b"partial")
            if idle:
                old = time.time() - OLD_S
                os.utime(root / name, (old, old))
        removed = {Path(p).relative_to(root).as_posix() for p in store.clean_orphans()}
    finally:
        zombie.wait()
    gone = {k for k, (name, _) in names.items() if name in removed}
    assert gone == {"dead pid here", "zombie here", "other host, idle", "older otfload, idle"}
    assert all((root / name).exists() != (k in gone) for k, (name, _) in names.items())


def test_temporary_objects_of_dead_writers_are_removed_from_a_gs_cache(gs_cache, gcs_server: GcsServer):
    prefix, options = gs_cache
    store = FsspecStore(prefix, "key", options)
    fs = gcs_server.filesystem()
    root = f"{prefix.removeprefix('gs://')}/key"
    dead = f"{root}/.a.safetensors.partial-{HOST_TAG}-{_dead_pid()}-0123456789ab"
    live = f"{root}/{partial_name('b.safetensors')}"
    for path in (dead, live):
        fs.pipe_file(path, b"partial")
    removed = store.clean_orphans()
    fs.invalidate_cache()
    assert removed == [f"gs://{dead}"] and fs.find(root) == [live]


# --- cache locations that cannot be used -----------------------------------------------------------


@pytest.mark.parametrize("where", ["the cache directory", "a folder above it", "the source's folder in it"])
def test_a_file_where_the_cache_directory_should_be_is_a_typed_error_naming_it(where, upload, open_gcs, tmp_path: Path):
    source = open_gcs(upload(FILES))
    cache_dir = tmp_path / "cache"
    blocker = {
        "the cache directory": cache_dir,
        "a folder above it": tmp_path,
        "the source's folder in it": cache_dir / cache_key(source),
    }[where]
    if where == "a folder above it":
        cache_dir = tmp_path / "file" / "cache"
        blocker = tmp_path / "file"
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_bytes(b"a file, not a folder")
    with pytest.raises(CacheStorageError, match="a file stands where a folder should be") as info:
        fill(source, cache_dir)
    assert str(blocker) in info.value.path and info.value.errno in (errno.EEXIST, errno.ENOTDIR)
    assert blocker.read_bytes() == b"a file, not a folder"


def _file_source(files_dir: Path) -> str:
    return f"file://{files_dir}"


def test_a_read_only_cache_is_a_typed_error_and_a_prefilled_one_still_serves(files_dir: Path, tmp_path: Path):
    empty, prefilled = tmp_path / "ro-empty", tmp_path / "ro-filled"
    empty.mkdir()
    fill(FsspecSource(_file_source(files_dir)), prefilled)
    spec = {"source": _file_source(files_dir), "runs": [{"cache_dir": str(empty)}, {"cache_dir": str(prefilled)}]}
    if private_mounts_available():  # a read-only bind mount: EROFS, for root too
        script = "\n".join(f"mount --bind {d} {d}\nmount -o remount,bind,ro {d}" for d in (empty, prefilled))
        fresh, reuse = run_fills(spec, tmp_path, script)
        expected = errno.EROFS
    elif os.geteuid() != 0:  # permissions stop an ordinary user
        for d in (empty, *prefilled.rglob("*"), prefilled):
            d.chmod(0o555 if d.is_dir() else 0o444)
        fresh, reuse = run_fills(spec, tmp_path)
        expected = errno.EACCES
    else:
        pytest.skip("running as root without user namespaces: chmod does not stop root, and no read-only mount")
    assert fresh["error"]["type"] == "CacheStorageError", fresh
    assert fresh["error"]["errno"] == expected and fresh["error"]["path"].startswith(str(empty))
    assert "read-only" in fresh["error"]["message"] and fresh["left"] == []
    assert reuse["error"] is None and reuse["fetched"] == [] and reuse["reused"] == sorted(FILES)


def test_a_full_cache_is_a_typed_error_naming_the_file_and_leaves_no_temporary(files_dir: Path, tmp_path: Path):
    if not private_mounts_available():
        pytest.skip("no private mount namespace here (unshare --user --mount) for a small tmpfs")
    cache = tmp_path / "small"
    cache.mkdir()
    spec = {"source": _file_source(files_dir), "runs": [{"cache_dir": str(cache)}]}
    # 64 KiB of tmpfs: the small files fit, the 70 kB shard does not.
    [outcome] = run_fills(spec, tmp_path, f"mount -t tmpfs -o size=64k tmpfs {cache}")
    error = outcome["error"]
    assert error["type"] == "CacheStorageError" and error["errno"] == errno.ENOSPC, outcome
    assert error["path"].startswith(str(cache)) and "full" in error["message"]
    assert not any(".partial-" in name for name in outcome["left"])


def test_a_file_size_limit_is_a_typed_error_naming_the_file(files_dir: Path, tmp_path: Path):
    spec = {"source": _file_source(files_dir), "runs": [{"cache_dir": str(tmp_path / "c")}], "fsize_limit": 16384}
    [outcome] = run_fills(spec, tmp_path)
    error = outcome["error"]
    assert error["type"] == "CacheStorageError" and error["errno"] == errno.EFBIG, outcome
    assert error["path"].endswith(SHARD) and "after 16384 bytes" in error["message"]
    assert not any(".partial-" in name or name.endswith(f"/{SHARD}") for name in outcome["left"])
    assert issubclass(CacheStorageError, CacheError)
