"""Real 4-process × 2-device loads whose processes differ in what they did before, and in what
they would choose (issue 34): every choice that leads to a collective is agreed, so they all make the
same choices and finish; a forced disagreement, or a process that never arrives, ends the load on
every process with a typed error within the bound — never a hang.

One job runs every load (starting 4 JAX processes costs more than a tiny load):

0. process 3 alone loads the checkpoint on a mesh of its own two devices (its page cache is now
   warm, and it has loaded a model before the others);
1. all four load it on the global ``fsdp=2, tp=4`` mesh, processes 0-2 cold (page cache dropped),
   process 3 warm, ``reshard="auto"``;
2. all four load again, process 3's read layouts forced to drop one band;
3. processes 0-2 load, process 3 does not come.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from benchmarks.make_checkpoint import write_checkpoint
from tests.multihost.conftest import flat_params
from tests.multihost.fetch import run_fetch_workers
from tests.multihost.test_fetch import DIMS, LOCAL_DEVICES, PROCESSES, TARGET, accounts_disk_reads

MESH = {"fsdp": 2, "tp": 4}  # every attention and MLP kernel a column block per process
BOUND_S = 15  # OTFLOAD_COLLECTIVE_TIMEOUT of the failing loads
SLACK_S = 20  # a 2-core machine shared by 4 JAX processes and more: scheduling, not waiting
JOB_TIMEOUT_S = 600.0


@pytest.fixture(scope="module")
def job(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("agree")
    checkpoint = write_checkpoint(root / "llama", DIMS, shard_bytes=8 * 10**6)
    for i in range(PROCESSES):
        shutil.copytree(checkpoint, root / f"copy{i}")
    os.sync()  # clean pages only can be evicted
    source = str(root / "copy{i}")
    loads = [
        {"only": [3], "local_mesh": True, "mesh": {"fsdp": LOCAL_DEVICES}},  # warms process 3's copy
        {"mesh": MESH, "evict": True, "evict_except": 3, "env": "auto", "gather": True},  # 3 stays warm
        {"mesh": MESH, "env": "auto", "mismatch": 3, "timeout": BOUND_S, "expect_error": True},
        {"mesh": MESH, "env": "auto", "only": [0, 1, 2], "timeout": BOUND_S, "expect_error": True},
    ]
    results = run_fetch_workers({"local_devices": LOCAL_DEVICES, "source": source, "loads": loads},
                                PROCESSES, root / "out", JOB_TIMEOUT_S)  # fmt: skip
    return {"loads": [[r["loads"][k] for r in results] for k in range(len(loads))], "checkpoint": checkpoint,
            "gathered": root / "out" / "params1.npz", "accounted": accounts_disk_reads(root / "copy0")}


def test_processes_with_different_histories_make_the_same_choices_and_finish(job, mesh_2x4):
    import otfload

    loaded = job["loads"][1]
    assert len({tuple(r["resharded"]) for r in loaded}) == 1 and loaded[0]["resharded"]  # the same bands
    assert len({r["route"] for r in loaded}) == 1  # ... for the same, agreed reason
    assert "local files cold on process(es) [0, 1, 2] (resident: " in loaded[0]["route"], loaded[0]["route"]
    for r in loaded:  # cold local disks: each process fetches about what its devices hold
        assert r["bytes_read"] == r["bytes_planned"] <= TARGET * r["bytes_ideal"], r["summary"]
    if job["accounted"]:
        for r in loaded[:3]:  # the cold ones: what the disk served
            assert r["kernel_read_bytes"] <= TARGET * r["bytes_ideal"] + 2 * 2**20, r
    reference = flat_params(otfload.from_pretrained(job["checkpoint"], mesh=mesh_2x4))  # one process, in place
    with np.load(job["gathered"]) as gathered:
        assert sorted(gathered.files) == sorted(reference)
        for name, want in reference.items():  # np.savez keeps bfloat16 as 2-byte voids: compare the bits
            np.testing.assert_array_equal(gathered[name].view(want.dtype), want, err_msg=name)


def test_a_forced_disagreement_ends_the_load_on_every_process_naming_the_leaf(job):
    failed = job["loads"][2]
    first_band = job["loads"][1][0]["resharded"][0]  # the band process 3 dropped
    assert {r["error"] for r in failed} == {"CollectiveMismatchError"}, failed
    assert {r["leaf"] for r in failed} == {first_band}
    assert all(r["seconds"] < BOUND_S + SLACK_S for r in failed), [r["seconds"] for r in failed]


def test_a_process_that_never_arrives_ends_the_load_within_the_bound(job):
    waited = job["loads"][3][:3]
    assert job["loads"][3][3] == {"process": 3, "skipped": True}
    assert {r["error"] for r in waited} == {"CollectiveTimeoutError"}, waited
    assert all(r["processes"] == [3] for r in waited)
    assert all(BOUND_S <= r["seconds"] < BOUND_S + SLACK_S for r in waited), [r["seconds"] for r in waited]
