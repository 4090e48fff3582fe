"""Real multi-process loads: 2 and 4 JAX processes on localhost (gloo CPU collectives), each with 2
CPU devices, loading one tiny Llama sharded over all of them (``fsdp=processes, tp=2``) through the
distributed shard cache."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np

from tests.multihost.conftest import FAST_RETRY, checkpoint_bytes, visible_files
from tests.multihost.launch import run_workers
from tests.servers.gcs_server import GcsServer
from tests.servers.hub_server import HubServer

LOCAL_DEVICES = 2


def assert_params_equal(out: Path, reference: dict[str, np.ndarray]) -> None:
    with np.load(out / "params.npz") as gathered:
        assert sorted(gathered.files) == sorted(reference)
        for name, want in reference.items():
            np.testing.assert_array_equal(gathered[name], want, err_msg=name)


def assert_reads_only_its_share(results: list[dict], total: int) -> None:
    for r in results:
        assert r["ideal_bytes"] < 0.6 * total  # most bytes are really split among the processes
        assert r["bytes_read"] <= 1.1 * r["ideal_bytes"], r


def test_four_processes_fetch_each_file_once_and_read_only_their_share(
    hub: HubServer, llama_repo, llama, reference_params, tmp_path
):
    cache = tmp_path / "shared-cache"
    spec = {"mode": "load", "local_devices": LOCAL_DEVICES, "source": llama_repo, "retry": FAST_RETRY,
            "source_options": {"endpoint": hub.url, "cache_dir": str(tmp_path / "hf")},
            "cache_dir": str(cache)}  # fmt: skip
    results = run_workers(spec, 4, tmp_path / "out")

    files = checkpoint_bytes(llama)
    gets = hub.requests("GET", "/resolve/")
    assert Counter(r.path.rsplit("/", 1)[1] for r in gets) == dict.fromkeys(files, 1)  # once each, cluster-wide
    assert all(r.range == f"bytes=0-{len(files[r.path.rsplit('/', 1)[1]]) - 1}" for r in gets)  # whole files
    fetched = [f for r in results for f in r["fetched"]]
    assert sorted(fetched) == sorted(files) and all(r["fetched"] for r in results)  # the work was split
    shards = {f: b for f, b in files.items() if f.endswith(".safetensors")}
    visible = visible_files(cache)
    records = {f.removesuffix(".sha256"): json.loads(v)["sha256"] for f, v in visible.items() if f.endswith(".sha256")}
    assert {f: v for f, v in visible.items() if not f.endswith(".sha256")} == files  # whole files only
    assert records == {f: hashlib.sha256(b).hexdigest() for f, b in files.items()}  # each recorded as checked
    assert_reads_only_its_share(results, sum(map(len, shards.values())))
    assert_params_equal(tmp_path / "out", reference_params)


def test_two_processes_load_from_gcs_through_a_gs_cache(
    gcs_server: GcsServer, llama_bucket, llama, reference_params, tmp_path
):
    prefix = f"gs://otfload-cache/{tmp_path.name}"
    spec = {"mode": "load", "local_devices": LOCAL_DEVICES, "source": llama_bucket, "retry": FAST_RETRY,
            "source_options": {"storage_options": gcs_server.storage_options}, "cache_dir": prefix,
            "cache_options": gcs_server.storage_options}  # fmt: skip
    fs = gcs_server.filesystem()
    fs.mkdir("otfload-cache")
    results = run_workers(spec, 2, tmp_path / "out")

    files = checkpoint_bytes(llama)
    fetched = [f for r in results for f in r["fetched"]]
    assert sorted(fetched) == sorted(files)  # each file fetched by exactly one process
    fs.invalidate_cache()
    cached = {p.rsplit("/", 1)[1]: fs.cat_file(p) for p in fs.find(prefix)}
    assert {k: v for k, v in cached.items() if not k.endswith(".sha256")} == files  # no partial objects
    assert {k for k in cached if k.endswith(".sha256")} == {f"{f}.sha256" for f in files}  # a record per file
    assert_reads_only_its_share(results, sum(len(b) for f, b in files.items() if f.endswith(".safetensors")))
    assert_params_equal(tmp_path / "out", reference_params)


def test_a_process_waiting_for_a_stalled_peer_gets_a_typed_error_in_bounded_time(hub: HubServer, llama_repo, tmp_path):
    spec = {"mode": "stall", "local_devices": 1, "stall_s": 6, "source": llama_repo, "timeout_s": 2,
            "source_options": {"endpoint": hub.url, "cache_dir": str(tmp_path / "hf")},
            "cache_dir": str(tmp_path / "cache")}  # fmt: skip
    outcome = run_workers(spec, 2, tmp_path / "out")[0]
    assert outcome["error"] == "CacheTimeoutError", outcome
    assert outcome["attrs"]["process"] == 1 and outcome["attrs"]["waiter"] == 0
    assert outcome["attrs"]["file"] in outcome["message"] and "process 1" in outcome["message"]
    assert 2 <= outcome["seconds"] < 6
