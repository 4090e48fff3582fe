"""Real 4-process × 2-device loads that measure what each process fetched (issue 17), and whose
processes differ in what they did before and in what they would choose (issue 34).

A mesh that splits the tensors' contiguous (column) axis makes direct reads fetch most of every row
(pages, merged ranges). Read as bands in the storage's own layout and resharded on the devices, each
process fetches its share — within 1.25× the ideal — and the report says what really moved: the
bytes the Hub server sent, and the kernel's ``/proc/self/io`` for cold local files. Leaves several
processes hold (replicated, or split on mesh axes inside one process only) are read once cluster-wide
the same way: all processes together read the checkpoint's bytes once, within 5 %.

Every choice that leads to a collective is agreed, so processes with different histories make the
same choices and finish; a forced disagreement, or a process that never arrives, ends the load on
every process with a typed error within the bound — never a hang.

Starting 4 JAX processes costs more than a tiny load, so every load runs in one job: first from two
Hub servers (one per mesh, so each server's counts are one load's), then every cold local load (both
meshes' shares, then both read-once meshes, per-process then read-once), then the agreement loads:

1. process 3 alone loads the checkpoint on a mesh of its own two devices (its page cache is now
   warm, and it has loaded a model before the others);
2. all four load it on the global ``fsdp=2, tp=4`` mesh, processes 0-2 cold (page cache dropped),
   process 3 warm, ``reshard="auto"``;
3. all four load again, process 3's read layouts forced to drop one band;
4. processes 0-2 load, process 3 does not come.

The tests check their own loads' results; loaded values are compared by their shards' digests
(:func:`assert_shards_equal`), not gathered.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from benchmarks.make_checkpoint import Dims, write_checkpoint
from tests.multihost.conftest import flat_params
from tests.multihost.fetch import run_fetch_workers
from tests.servers.hub_server import HubServer

PROCESSES, LOCAL_DEVICES = 4, 2
MESHES = {"fsdp8": {"fsdp": 8}, "fsdp2_tp4": {"fsdp": 2, "tp": 4}}
# bf16 rows of 1 KiB: a column split over 8 devices leaves 128 bytes per device in every 4 KiB page.
DIMS = Dims(hidden=512, intermediate=1408, layers=2, vocab=4096)
TARGET = 1.25  # fetched / ideal bytes per process
# Each byte from the source once: bytes all processes read / checkpoint bytes.
ONCE = 1.05
# tp=8 replicates k/v (4 KV heads do not split 8 ways) and every leaf's embed dim; fsdp=4 × tp=2 gives
# each process a column block of most tensors: read in place, both read the checkpoint 2-3.5 times.
ONCE_MESHES = {"tp8": {"tp": 8}, "fsdp4_tp2": {"fsdp": 4, "tp": 2}}
# One 128 MB file: the 256 KiB header prefix each process reads (HEADER_PREFETCH_BYTES) is < 1 % of it.
ONCE_DIMS = Dims(hidden=1024, intermediate=2816, layers=4, vocab=8192)
# Each read-once job runs two cold loads: the per-process mode and the read-once mode, asked for through
# ``from_pretrained(reshard=...)`` (tp8) or ``$OTFLOAD_RESHARD`` under an explicit ``reshard=`` (fsdp4_tp2).
ONCE_LOADS = {
    "tp8": [{"reshard": "never"}, {"reshard": "always"}],
    "fsdp4_tp2": [{"env": "always", "reshard": "never"}, {"env": "always"}],
}
BOUND_S = 15  # OTFLOAD_COLLECTIVE_TIMEOUT of the failing loads
SLACK_S = 20  # a 2-core machine shared by 4 JAX processes and more: scheduling, not waiting
AGREE_MESH = MESHES["fsdp2_tp4"]  # every attention and MLP kernel a column block per process
# The agreement loads, in order (see the module's docstring).
AGREE_LOADS = {
    # process 3's copy, dropped by the loads before, read whole (a cold load's O_DIRECT reads would leave
    # it cold) and loaded
    "warm": {"only": [3], "local_mesh": True, "mesh": {"fsdp": LOCAL_DEVICES}, "warm": True},
    "different_histories": {"mesh": AGREE_MESH, "evict": True, "evict_except": 3, "env": "auto", "digest": True},
    "mismatch": {"mesh": AGREE_MESH, "env": "auto", "mismatch": 3, "timeout": BOUND_S, "expect_error": True},
    "absent": {"mesh": AGREE_MESH, "env": "auto", "only": [0, 1, 2], "timeout": BOUND_S, "expect_error": True},
}
# Twelve loads in one job: well past their time on a loaded 2-core machine.
JOB_TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("fetch") / "llama", DIMS, shard_bytes=8 * 10**6)


@pytest.fixture(scope="module")
def once_checkpoint(tmp_path_factory) -> Path:
    return write_checkpoint(tmp_path_factory.mktemp("once") / "llama", ONCE_DIMS)


@pytest.fixture(scope="module")
def job(checkpoint, once_checkpoint, tmp_path_factory) -> Iterator[dict]:
    """Every load of this module in one 4-process job: ``{"loads": {name: every process's result},
    "hub": {mesh: its server}, "accounted": whether reads show in /proc/self/io}``. Hub loads
    (``hub/<mesh>``) come first, each mesh from its own server; then the cold local loads, each
    process reading its own copy (separate hosts do not share a page cache): ``share/<mesh>``
    (``always``), ``once/<mesh>/<k>`` (per-process, then read-once); then ``agree/<name>``
    (:data:`AGREE_LOADS`)."""
    root = tmp_path_factory.mktemp("fetch-job")
    for name, source in (("share", checkpoint), ("once", once_checkpoint)):
        for i in range(PROCESSES):
            shutil.copytree(source, root / f"{name}{i}")
    accounted = accounts_disk_reads(root / "share0")
    os.sync()  # clean pages only can be evicted
    share = str(root / "share{i}")
    # Remote column reads cost a request per row: the time model reads those leaves as bands.
    with HubServer(root / "fsdp8") as first, HubServer(root / "fsdp2_tp4") as second:
        servers = dict(zip(MESHES, (first, second), strict=True))
        loads = {f"hub/{m}": {"mesh": MESHES[m], "source": s.add_repo(f"org/fetch-{m}", checkpoint),
                              "endpoint": s.url, "env": "auto"} for m, s in servers.items()}  # fmt: skip
        loads |= {f"share/{m}": {"mesh": MESHES[m], "source": share, "env": "always", "evict": True,
                                 "digest": m == "fsdp2_tp4"} for m in MESHES}  # fmt: skip
        loads |= {f"once/{m}/{k}": {"mesh": ONCE_MESHES[m], "source": str(root / "once{i}"), "evict": True,
                                    "digest": True, **how}
                  for m in ONCE_MESHES for k, how in enumerate(ONCE_LOADS[m])}  # fmt: skip
        loads |= {f"agree/{name}": {"source": share, **how} for name, how in AGREE_LOADS.items()}
        results = run_fetch_workers({"local_devices": LOCAL_DEVICES, "loads": list(loads.values())}, PROCESSES,
                                    root / "out", JOB_TIMEOUT_S)  # fmt: skip
        yield {"loads": {name: [r["loads"][k] for r in results] for k, name in enumerate(loads)}, "hub": servers,
               "accounted": accounted}  # fmt: skip


@pytest.fixture(scope="module")
def reference(checkpoint, mesh_2x4) -> dict[str, np.ndarray]:
    """The parameters of a one-process load of ``checkpoint``, read in place."""
    import otfload

    return flat_params(otfload.from_pretrained(checkpoint, mesh=mesh_2x4))


def digest(array: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(array).tobytes()).hexdigest()


def assert_shards_equal(results: list[dict], reference: dict[str, np.ndarray]) -> None:
    """Every process's shards (``digest`` loads) hold exactly ``reference``'s bytes, and together
    they cover each of its leaves."""
    for r in results:
        assert sorted(r["shards"]) == sorted(reference)
    for name, want in reference.items():
        covered = np.zeros(want.shape, bool)
        for r in results:
            for box, sha in r["shards"][name]:
                index = tuple(slice(a, b) for a, b in box)
                assert sha == digest(want[index]), (name, box, r["process"])
                covered[index] = True
        assert covered.all(), name


@pytest.mark.parametrize("mesh", list(MESHES))
def test_each_process_fetches_its_share_from_the_hub(job, checkpoint, mesh):
    results, hub = job["loads"][f"hub/{mesh}"], job["hub"][mesh]
    reported = sum(r["bytes_read"] for r in results)
    assert reported <= hub.body_bytes <= reported + PROCESSES * served_headers(checkpoint)  # headers: before the load
    gets = len(hub.requests("GET", "/resolve/"))
    assert sum(r["requests"] for r in results) <= gets <= sum(r["requests"] for r in results) + PROCESSES * 8
    for r in results:
        assert r["resharded"], r["summary"]
        assert r["bytes_read"] == r["bytes_planned"] <= TARGET * r["bytes_ideal"], r["summary"]


def served_headers(checkpoint: Path) -> int:
    """Bytes a process fetches before the load: every JSON file and each safetensors header (read
    with a speculative prefix of HEADER_PREFETCH_BYTES)."""
    from otfload.index.header import HEADER_PREFETCH_BYTES

    total = 0
    for path in checkpoint.iterdir():
        if path.suffix == ".safetensors":
            with open(path, "rb") as f:
                header = 8 + int.from_bytes(f.read(8), "little")
            total += max(header, min(HEADER_PREFETCH_BYTES, path.stat().st_size))
        elif path.suffix == ".json":
            total += path.stat().st_size
    return total


def accounts_disk_reads(directory: Path) -> bool:
    """Whether reads of files under ``directory`` show in ``/proc/self/io`` (not on tmpfs)."""
    from tests.multihost.fetch_worker import disk_read_bytes, evict

    path = next(directory.glob("*.safetensors"))
    os.sync()
    evict(directory)
    before = disk_read_bytes()
    with open(path, "rb") as f:
        f.read(1 << 16)
    return disk_read_bytes() > before


def test_band_reads_resharded_on_the_devices_load_the_same_model(job, reference):
    results = job["loads"]["share/fsdp2_tp4"]  # "always": column splits as bands
    assert all(r["resharded"] for r in results)
    assert len({tuple(r["resharded"]) for r in results}) == 1  # the same choices everywhere
    assert_shards_equal(results, reference)


@pytest.mark.parametrize("mesh", list(MESHES))
def test_each_process_fetches_its_share_of_cold_local_files(job, checkpoint, mesh):
    results = job["loads"][f"share/{mesh}"]
    for r in results:
        assert r["bytes_read"] == r["bytes_planned"] <= TARGET * r["bytes_ideal"], r["summary"]
    if not job["accounted"]:
        pytest.skip("reads on this filesystem do not show in /proc/self/io")
    headers = served_headers(checkpoint) + 3 * 4096 * len(list(checkpoint.glob("*.safetensors")))
    for r in results:
        assert abs(r["kernel_read_bytes"] - r["bytes_read"]) <= 0.05 * r["bytes_read"] + headers, r


@pytest.mark.parametrize("mesh", list(ONCE_MESHES))
def test_each_byte_is_read_once_cluster_wide_and_resharded_to_the_same_arrays(job, once_checkpoint, mesh):
    per_process, once = job["loads"][f"once/{mesh}/0"], job["loads"][f"once/{mesh}/1"]
    assert not any(r["resharded"] for r in per_process)  # "never" reached the loader
    assert all(r["resharded"] for r in once) and len({tuple(r["resharded"]) for r in once}) == 1
    for direct, moved in zip(per_process, once, strict=True):  # bit-identical to the per-process mode, shard by shard
        assert sorted(moved["shards"]) == sorted(direct["shards"])
        for name, shards in direct["shards"].items():
            assert moved["shards"][name] == shards, (name, direct["process"])
    if not job["accounted"]:
        pytest.skip("reads on this filesystem do not show in /proc/self/io")
    size = sum(p.stat().st_size for p in once_checkpoint.glob("*.safetensors"))
    read_once = sum(r["kernel_read_bytes"] for r in once) / size  # what the disk really served
    read_each = sum(r["kernel_read_bytes"] for r in per_process) / size
    assert read_once <= ONCE < 1.5 < read_each, (read_once, read_each, [r["summary"] for r in once])


def test_processes_with_different_histories_make_the_same_choices_and_finish(job, reference):
    loaded = job["loads"]["agree/different_histories"]
    assert len({tuple(r["resharded"]) for r in loaded}) == 1 and loaded[0]["resharded"]  # the same bands
    assert len({r["route"] for r in loaded}) == 1  # ... for the same, agreed reason
    assert "local files cold on process(es) [0, 1, 2] (resident: " in loaded[0]["route"], loaded[0]["route"]
    for r in loaded:  # cold local disks: each process fetches about what its devices hold
        assert r["bytes_read"] == r["bytes_planned"] <= TARGET * r["bytes_ideal"], r["summary"]
    if job["accounted"]:
        for r in loaded[:3]:  # the cold ones: what the disk served
            assert r["kernel_read_bytes"] <= TARGET * r["bytes_ideal"] + 2 * 2**20, r
    assert_shards_equal(loaded, reference)


def test_a_forced_disagreement_ends_the_load_on_every_process_naming_the_leaf(job):
    failed = job["loads"]["agree/mismatch"]
    first_band = job["loads"]["agree/different_histories"][0]["resharded"][0]  # the band process 3 dropped
    assert {r["error"] for r in failed} == {"CollectiveMismatchError"}, failed
    assert {r["leaf"] for r in failed} == {first_band}
    assert all(r["seconds"] < BOUND_S + SLACK_S for r in failed), [r["seconds"] for r in failed]


def test_a_process_that_never_arrives_ends_the_load_within_the_bound(job):
    waited = job["loads"]["agree/absent"][:3]
    assert job["loads"]["agree/absent"][3] == {"process": 3, "skipped": True}
    assert {r["error"] for r in waited} == {"CollectiveTimeoutError"}, waited
    assert all(r["processes"] == [3] for r in waited)
    assert all(BOUND_S <= r["seconds"] < BOUND_S + SLACK_S for r in waited), [r["seconds"] for r in waited]
