"""Real multi-process loads: 2 JAX processes on localhost (gloo CPU collectives), each with 2 CPU
devices, loading one tiny Llama sharded over all of them (``fsdp=processes, tp=2``) through the
distributed shard cache, from the Hub and from GCS, and a process waiting for a stalled peer.

Starting JAX processes costs more than a tiny load, so one job runs every scenario in turn (the stall
last: its sleeping process opens no cache); the tests check their own scenario's results."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from tests.multihost.conftest import FAST_RETRY, REPO, checkpoint_bytes, visible_files
from tests.multihost.launch import run_scenarios
from tests.servers.gcs_server import GcsServer
from tests.servers.hub_server import HubServer

PROCESSES, LOCAL_DEVICES = 2, 2
STALLED = "org/llama-mh-stalled"  # the stall scenario's repo: the load's requests stay apart
# Three scenarios of 2 processes: well past their time on a loaded 2-core machine.
JOB_TIMEOUT_S = 300.0


@pytest.fixture(scope="module")
def job(gcs_server: GcsServer, llama_bucket, llama, tmp_path_factory):
    """Every scenario in one job: ``(results by scenario, its out directory, the Hub server, the gs://
    cache prefix)``. The Hub is this module's own server, so its request log is this job's."""
    root = tmp_path_factory.mktemp("multihost")
    prefix = f"gs://otfload-cache/{root.name}"
    gcs_server.filesystem().mkdir("otfload-cache")
    with HubServer(root / "hub-root") as hub:
        hub.add_repo(REPO, llama)
        hub.add_repo(STALLED, llama)
        hub_options = {"endpoint": hub.url, "cache_dir": str(root / "hf")}
        scenarios = {
            "hub": {"mode": "load", "source": REPO, "source_options": hub_options, "cache_dir": str(root / "cache")},
            "gcs": {"mode": "load", "source": llama_bucket, "cache_dir": prefix, "cache_options":
                    gcs_server.storage_options, "source_options": {"storage_options": gcs_server.storage_options}},
            "stall": {"mode": "stall", "stall_s": 6, "source": STALLED, "timeout_s": 2, "source_options": hub_options,
                      "cache_dir": str(root / "stall-cache")},
        }  # fmt: skip
        results = run_scenarios({"local_devices": LOCAL_DEVICES, "retry": FAST_RETRY}, scenarios, PROCESSES,
                                root / "out", JOB_TIMEOUT_S)  # fmt: skip
        yield results, root, hub, prefix


def assert_params_equal(out: Path, reference: dict[str, np.ndarray]) -> None:
    with np.load(out / "params.npz") as gathered:
        assert sorted(gathered.files) == sorted(reference)
        for name, want in reference.items():
            np.testing.assert_array_equal(gathered[name], want, err_msg=name)


def assert_reads_only_its_share(results: list[dict], total: int) -> None:
    for r in results:
        assert r["ideal_bytes"] < 0.6 * total  # most bytes are really split among the processes
        assert r["bytes_read"] <= 1.1 * r["ideal_bytes"], r


def test_processes_fetch_each_file_once_and_read_only_their_share(job, llama, reference_params):
    results, root, hub, _ = job
    results = results["hub"]
    files = checkpoint_bytes(llama)
    gets = hub.requests("GET", f"{REPO}/resolve/")
    assert Counter(r.path.rsplit("/", 1)[1] for r in gets) == dict.fromkeys(files, 1)  # once each, cluster-wide
    assert all(r.range == f"bytes=0-{len(files[r.path.rsplit('/', 1)[1]]) - 1}" for r in gets)  # whole files
    fetched = [f for r in results for f in r["fetched"]]
    assert sorted(fetched) == sorted(files) and all(r["fetched"] for r in results)  # the work was split
    shards = {f: b for f, b in files.items() if f.endswith(".safetensors")}
    visible = visible_files(root / "cache")
    records = {f.removesuffix(".sha256"): json.loads(v)["sha256"] for f, v in visible.items() if f.endswith(".sha256")}
    assert {f: v for f, v in visible.items() if not f.endswith(".sha256")} == files  # whole files only
    assert records == {f: hashlib.sha256(b).hexdigest() for f, b in files.items()}  # each recorded as checked
    assert_reads_only_its_share(results, sum(map(len, shards.values())))
    assert_params_equal(root / "out" / "hub", reference_params)


def test_processes_load_from_gcs_through_a_gs_cache(job, gcs_server: GcsServer, llama, reference_params):
    results, root, _, prefix = job
    results = results["gcs"]
    files = checkpoint_bytes(llama)
    fetched = [f for r in results for f in r["fetched"]]
    assert sorted(fetched) == sorted(files)  # each file fetched by exactly one process
    fs = gcs_server.filesystem()
    fs.invalidate_cache()
    cached = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(prefix)}
    assert {k: v for k, v in cached.items() if not k.endswith(".sha256")} == files  # no partial objects
    assert {k for k in cached if k.endswith(".sha256")} == {f"{f}.sha256" for f in files}  # a record per file
    assert_reads_only_its_share(results, sum(len(b) for f, b in files.items() if f.endswith(".safetensors")))
    assert_params_equal(root / "out" / "gcs", reference_params)


def test_a_process_waiting_for_a_stalled_peer_gets_a_typed_error_in_bounded_time(job):
    outcome = job[0]["stall"][0]
    assert outcome["error"] == "CacheTimeoutError", outcome
    assert outcome["attrs"]["process"] == 1 and outcome["attrs"]["waiter"] == 0
    assert outcome["attrs"]["file"] in outcome["message"] and "process 1" in outcome["message"]
    assert 2 <= outcome["seconds"] < 6
