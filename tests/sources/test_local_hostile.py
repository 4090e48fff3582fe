"""LocalSource against hostile files: special files, truncation under a mapping, replaced files, and
more files than descriptors. Every outcome is data equal to the file's bytes or a typed error naming
the file — never a hang, SIGBUS or a raw OSError (EMFILE, EACCES)."""

from __future__ import annotations

import contextlib
import os
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from otfload.errors import (
    CheckpointIndexError,
    CorruptFileError,
    SourceNotFoundError,
    SourcePermissionError,
    TruncatedFileError,
)
from otfload.index.checkpoint import open_index
from otfload.sources import LocalSource
from otfload.sources.base import read_bytes
from otfload.sources.local import FD_LIMIT_SHARE, MIN_OPEN_FILES, default_max_open_files

REPO = Path(__file__).resolve().parents[2]
# A blocked open() or read returns at once or never: anything past this is a hang.
HANG_S = 10.0
# A small pool, so that a few dozen files exercise eviction, reopening and the mapping cap.
SMALL_POOL = 6


def _files(root: Path, n: int, size: int = 3 * 4096 + 5) -> dict[str, bytes]:
    root.mkdir(parents=True, exist_ok=True)
    data = {f"f{i:03d}.bin": np.random.default_rng(i).bytes(size) for i in range(n)}
    for name, blob in data.items():
        (root / name).write_bytes(blob)
    return data


def _proc_fds(root: Path) -> int:
    """Descriptors of this process open on files under ``root``, as the kernel counts them."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{root}/")
    return count


def _in_child(code: str, *args: object) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh Python (no JAX) under a hard timeout; a SIGBUS there shows as rc -7."""
    return subprocess.run(
        [sys.executable, "-c", code, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=HANG_S * 3,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def test_directory_and_fifo_named_safetensors_are_typed_and_never_block(tmp_path: Path):
    (tmp_path / "dir.safetensors").mkdir()
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)  # nobody ever writes: a blocking open would wait forever
    src = LocalSource(tmp_path)
    outcome: dict[str, BaseException] = {}

    def probe() -> None:
        for name in ("dir.safetensors", "fifo.safetensors"):
            try:
                src.size(name)
            except BaseException as e:  # noqa: BLE001 - recorded and checked below
                outcome[name] = e

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(HANG_S)
    if thread.is_alive():
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # let the blocked open return
        pytest.fail("opening a FIFO blocked")
    assert isinstance(outcome["dir.safetensors"], SourceNotFoundError)
    assert "'dir.safetensors'" in str(outcome["dir.safetensors"]) and "a directory" in str(outcome["dir.safetensors"])
    assert isinstance(outcome["fifo.safetensors"], SourceNotFoundError)
    assert "'fifo.safetensors'" in str(outcome["fifo.safetensors"]) and "a FIFO" in str(outcome["fifo.safetensors"])
    assert src.open_files == 0  # the refused descriptors were closed
    # The listing holds only regular files, so an index naming either is a typed index error.
    assert src.list_files() == []
    (tmp_path / "model.safetensors.index.json").write_text('{"weight_map": {"w": "fifo.safetensors"}}')
    with pytest.raises(CheckpointIndexError, match="fifo.safetensors"):
        open_index(src, require_config=False)


def test_symlink_loop_is_typed(tmp_path: Path):
    (tmp_path / "loop.safetensors").symlink_to("loop.safetensors")
    with pytest.raises(SourceNotFoundError, match="'loop.safetensors'.*cannot be resolved"):
        LocalSource(tmp_path).size("loop.safetensors")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode: no EACCES to provoke")
def test_unreadable_file_is_a_permission_error_naming_it(tmp_path: Path):
    _files(tmp_path, 1)
    (tmp_path / "f000.bin").chmod(0)
    with pytest.raises(SourcePermissionError, match="f000.bin"):
        LocalSource(tmp_path).size("f000.bin")


def test_pool_stays_within_its_cap_under_concurrent_readers(tmp_path: Path):
    data = _files(tmp_path, 40)
    src = LocalSource(tmp_path, max_open_files=SMALL_POOL)
    errors: list[BaseException] = []
    peak = 0

    def worker(seed: int) -> None:
        nonlocal peak
        rng = random.Random(seed)
        try:
            for _ in range(300):
                name = rng.choice(list(data))
                offset = rng.randrange(len(data[name]) - 100)
                view = src.mapped(name, offset, 100) if rng.random() < 0.5 else None
                if view is not None:
                    src.prefetch(name, offset, 100)
                    assert bytes(np.frombuffer(view, np.uint8, 100, offset)) == data[name][offset : offset + 100]
                    del view
                else:
                    assert read_bytes(src, name, offset, 100) == data[name][offset : offset + 100]
                src.release(name, offset, 100)
                peak = max(peak, src.open_files)
        except BaseException as e:  # noqa: BLE001 - re-raised in the test thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(HANG_S * 6)
    assert not any(t.is_alive() for t in threads), "a reader waited forever for a descriptor"
    assert not errors, errors[0]
    assert 2 <= peak <= SMALL_POOL  # the pool was used, and never beyond its cap
    # At rest its count is the kernel's (sampled while threads open and close, /proc would count a
    # reused descriptor number twice; the 64-descriptor load test bounds the live count).
    assert _proc_fds(tmp_path) == src.open_files
    src.close()
    assert src.open_files == 0 and _proc_fds(tmp_path) == 0


def test_a_mapping_in_use_is_never_unmapped_under_its_reader(tmp_path: Path):
    data = _files(tmp_path, 10)
    src = LocalSource(tmp_path, max_open_files=4)  # two mappings at most
    names = list(data)
    held = np.frombuffer(src.mapped(names[0]), np.uint8)
    second = src.mapped(names[1])
    assert src.mapped(names[2]) is None  # both mapping slots are in use by views: read it instead
    assert read_bytes(src, names[2]) == data[names[2]]
    del second
    for name in names[3:]:  # evicts names[0]'s descriptor and mapping entry while `held` lives
        assert bytes(src.mapped(name)) == data[name]
    assert bytes(held) == data[names[0]]  # still mapped, still the file's bytes
    assert src.open_files <= 4
    del held
    src.close()
    assert src.open_files == 0  # the evicted mapping went with its last view


def test_file_replaced_after_first_open_is_refused(tmp_path: Path):
    data = _files(tmp_path, 8)
    src = LocalSource(tmp_path, max_open_files=4)
    assert read_bytes(src, "f000.bin", 0, 10) == data["f000.bin"][:10]
    for name in list(data)[1:]:  # evict f000.bin
        read_bytes(src, name, 0, 10)
    (tmp_path / "new").write_bytes(data["f000.bin"])
    os.replace(tmp_path / "new", tmp_path / "f000.bin")  # same bytes, another inode
    with pytest.raises(CorruptFileError, match="f000.bin.*replaced"):
        src.size("f000.bin")


_TRUNCATED_UNDER_MAPPING = """
import os, sys
from otfload.errors import TruncatedFileError
from otfload.sources import LocalSource
root, name, size = sys.argv[1], sys.argv[2], int(sys.argv[3])
src = LocalSource(root)
view = src.mapped(name, 0, size)           # checked and mapped while complete
os.truncate(os.path.join(root, name), 4096)
for step in ("prefetch", "mapped"):
    try:
        src.prefetch(name, 0, size) if step == "prefetch" else src.mapped(name, 0, size)
        print(step, "no error")
    except TruncatedFileError as e:
        print(step, type(e).__name__, e)
src.release(name, 0, size)                 # advisory: never raises, even beyond the file's end
print("released")
"""


def test_truncation_under_a_live_mapping_is_typed_not_sigbus(tmp_path: Path):
    data = _files(tmp_path, 1, size=1 << 20)
    done = _in_child(_TRUNCATED_UNDER_MAPPING, tmp_path, "f000.bin", len(data["f000.bin"]))
    assert done.returncode == 0, f"rc {done.returncode} (-7 is SIGBUS): {done.stderr[-2000:]}"
    lines = done.stdout.splitlines()
    assert lines[0].startswith("prefetch TruncatedFileError f000.bin:") and "only 4096 bytes" in lines[0]
    assert lines[1].startswith("mapped TruncatedFileError f000.bin:") and "only 4096 bytes" in lines[1]
    assert lines[2] == "released"


@pytest.mark.parametrize("use_mmap", [True, False])
def test_truncated_file_is_typed_with_bytes_expected_and_present(tmp_path: Path, use_mmap: bool):
    data = _files(tmp_path, 1)
    src = LocalSource(tmp_path, mmap=use_mmap)
    size = len(data["f000.bin"])
    os.truncate(tmp_path / "f000.bin", 1000)
    with pytest.raises(TruncatedFileError, match=rf"f000.bin: needs bytes \[0, {size}\) .* only 1000 bytes"):
        read_bytes(src, "f000.bin", 0, size)
    if use_mmap:
        with pytest.raises(TruncatedFileError, match=rf"needs bytes \[500, {size}\) .* only 1000 bytes"):
            src.mapped("f000.bin", 500, size - 500)
    else:
        assert src.mapped("f000.bin", 0, size) is None


_OUT_OF_DESCRIPTORS = """
import os, resource, sys
from otfload.errors import SourceUnavailableError
from otfload.sources import LocalSource
root = sys.argv[1]
resource.setrlimit(resource.RLIMIT_NOFILE, (32, 32))
src = LocalSource(root)
hogs = []
try:
    while True:
        hogs.append(os.open(root, os.O_RDONLY))   # someone else takes every descriptor
except OSError:
    pass
try:
    src.size("f000.bin")
    print("no error")
except SourceUnavailableError as e:
    print(type(e).__name__, e)
"""


def test_out_of_descriptors_is_typed_not_emfile(tmp_path: Path):
    _files(tmp_path, 1)
    done = _in_child(_OUT_OF_DESCRIPTORS, tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("SourceUnavailableError 'f000.bin'") and "out of file descriptors" in done.stdout


def test_default_cap_follows_the_descriptor_limit():
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = default_max_open_files()
    assert MIN_OPEN_FILES <= cap <= max(MIN_OPEN_FILES, soft // FD_LIMIT_SHARE)
