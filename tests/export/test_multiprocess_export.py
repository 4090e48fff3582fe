"""Export from 2 real JAX processes on localhost (gloo CPU collectives), the model sharded over
both (``fsdp=2`` across the processes, ``tp=4`` within each): bit-exact with the HF files and
byte-identical to a one-process export, scanned and unscanned."""

from __future__ import annotations

import json
import subprocess
import sys

import otfload
from otfload.export import export_hf
from tests.export.export_worker import LAYOUTS
from tests.export.test_export import assert_bit_exact, read_tensors, weight_map_keys
from tests.multihost.launch import REPO_ROOT, wait_workers, worker_env
from tests.servers.net import free_port

PROCESSES, LOCAL_DEVICES = 2, 4


def test_two_processes_write_one_export_together(tiny_checkpoints, mesh_2x4, tmp_path):
    src, _ = tiny_checkpoints("llama")
    spec = {"processes": PROCESSES, "local_devices": LOCAL_DEVICES, "port": free_port(), "src": str(src),
            "max_shard_size": "60KB", "out": str(tmp_path)}  # fmt: skip
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "tests.export.export_worker", str(tmp_path / "spec.json")]
    procs = [
        subprocess.Popen([*cmd, str(i)], cwd=REPO_ROOT, env=worker_env(), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)  # fmt: skip
        for i in range(PROCESSES)
    ]
    wait_workers(procs, timeout_s=90)  # kills both past the timeout; filters [Gloo] lines
    reports = [json.loads((tmp_path / f"proc{i}.json").read_text()) for i in range(PROCESSES)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary directory left

    for name, scan in LAYOUTS.items():
        out = tmp_path / name
        assert all(r[name]["split"] > 0 for r in reports)  # parameters really sharded across the processes
        assert all(r[name]["exists"] for r in reports)  # nobody returns before the output is in place
        wrote = [f for r in reports for f in r[name]["wrote"]]
        assert all(r[name]["wrote"] for r in reports)  # both processes wrote files ...
        assert sorted(wrote) == sorted(p.name for p in out.glob("*.safetensors"))  # ... each file once
        assert_bit_exact(read_tensors(out), read_tensors(src))
        assert weight_map_keys(out) == weight_map_keys(src)

        model = otfload.from_pretrained(src, mesh=mesh_2x4, scan_layers=scan)
        single = export_hf(model, tmp_path / f"single-{name}", reference=src, max_shard_size="60KB")
        assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in single.iterdir())
        for path in single.iterdir():
            assert (out / path.name).read_bytes() == path.read_bytes(), path.name
