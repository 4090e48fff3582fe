"""Plans at real size (issue 17 §3) and the choice of read layouts, without reading a tensor byte.

Sparse replicas (scripts/make_replica.py: real headers, holes for the data) of published checkpoints
plan like the real ones; ``inspect --process-index/--process-count`` plans one process of a mesh
larger than this machine's; the reshard time model picks band reads where direct reads of column
blocks would cost a request per row.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import otfload
from otfload.cli.inspect import inspect_source, summarize_names
from otfload.place.collective_route import TimeModel, choose_leaf, choose_read_shardings, process_devices
from otfload.read.planned import leaf_planned
from otfload.read.reader import TensorReader
from otfload.sources import LocalSource

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_replica.py"


def replica_module():
    spec = importlib.util.spec_from_file_location("make_replica", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_replica"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def gpt_oss_replica(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replica") / "gpt-oss-120b"
    replica_module().make_replica("gpt-oss-120b", out)
    return out


def test_replica_is_sparse_with_the_published_layout(gpt_oss_replica):
    files = sorted(gpt_oss_replica.glob("*.safetensors"))
    assert len(files) == 15
    size = sum(f.stat().st_size for f in files)
    assert size > 60e9  # the tensors' bytes: GPT-OSS-120B is ~65 GB
    assert sum(os.stat(f).st_blocks * 512 for f in files) < 10e6  # holes: nothing written
    index = json.loads((gpt_oss_replica / "model.safetensors.index.json").read_text())
    assert "model.layers.35.mlp.experts.gate_up_proj_blocks" in index["weight_map"]


@pytest.mark.parametrize("scan", [True, False])
def test_replica_plans_at_real_size(gpt_oss_replica, mesh_2x4, scan):
    _, plan, src = otfload.plan_model(gpt_oss_replica, mesh=mesh_2x4, scan_layers=scan)
    src.close()
    assert plan.unused == []
    assert plan.leaves["layers.moe.gate.kernel" if scan else "layers.35.moe.gate.kernel"].storage.startswith("mxfp4")
    assert 60e9 < plan.source_bytes < 66e9


@pytest.fixture(scope="module")
def llama_replica(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("replica") / "llama-3.1-405b"
    replica_module().make_replica("llama-3.1-405b", out)
    return out


def test_inspect_plans_one_process_of_a_larger_mesh(llama_replica):
    mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("fsdp", "tp"))
    whole = inspect_source(str(llama_replica), mesh=mesh, scan_layers=False)
    # Accelerators: the interconnect moves a band far faster than a shared store serves the extra pages.
    parts = [inspect_source(str(llama_replica), mesh=mesh, scan_layers=False, process_index=i, process_count=4,
                            platform="tpu") for i in (0, 3)]  # fmt: skip
    assert whole["processes"] == 1 and [(p["processes"], p["process_index"]) for p in parts] == [(4, 0), (4, 3)]
    total = whole["totals"]  # one process holds every device: each byte once, nothing resharded
    assert total["fetch_bytes"] == total["process_bytes"] == total["ideal_bytes"] == total["source_bytes"]
    assert total["resharded_leaves"] == 0
    for p in parts:  # a quarter of the devices (q, k, v, gate, up split on their columns): read as bands
        t = p["totals"]
        assert t["ideal_bytes"] < 0.3 * total["ideal_bytes"]
        assert t["fetch_bytes"] <= 1.1 * t["ideal_bytes"] and t["resharded_leaves"] > 0


def test_unused_tensors_are_summarised_by_pattern():
    names = [f"model.layers.61.mlp.experts.{e}.{p}_proj.weight" for e in range(256) for p in ("gate", "up")]
    names += ["model.layers.61.enorm.weight", "model.layers.3.x.weight", "model.layers.5.x.weight"]
    lines = summarize_names(names)
    assert lines == ["model.layers.61.mlp.experts.{0..255}.gate_proj.weight (256)",
                     "model.layers.61.mlp.experts.{0..255}.up_proj.weight (256)",
                     "model.layers.61.enorm.weight", "model.layers.{3,5}.x.weight (2)"]  # fmt: skip
    many = summarize_names([f"t.{i}.{k}.w" for i in range(3) for k in ("a", "b", "c")], limit=2)
    assert many == ["t.{0..2}.a.w (3)", "t.{0..2}.b.w (3)", "... and 1 more patterns"]


def test_abstract_models_draw_no_random_numbers():
    from otfload.models.layers import make_param

    param = make_param(None, (3, 4), ("embed", "mlp"), np.float32, stack=2)
    assert param[...].shape == (2, 3, 4) and not np.asarray(param[...]).any()
    assert param.get_metadata()["logical_axes"] == ("layers", "embed", "mlp")


# --- the read layout's time model -------------------------------------------------------------------


class RemoteReader(TensorReader):
    """A reader planning as for a remote store (exact ranges, requests merged by the source)."""

    maps = False
    pages = False


@pytest.fixture(scope="module")
def column_split(tmp_path_factory):
    """A bf16 Llama whose rows (1 KiB) a fsdp=8 mesh splits into 128-byte column blocks."""
    from benchmarks.make_checkpoint import Dims, write_checkpoint

    path = write_checkpoint(tmp_path_factory.mktemp("cols") / "llama", Dims(512, 1408, 2, vocab=4096),
                            shard_bytes=8 * 10**6)  # fmt: skip
    mesh = Mesh(np.array(jax.devices()), ("fsdp",))
    _, plan, planned = otfload.plan_model(path, mesh=mesh)
    planned.close()
    with contextlib.closing(LocalSource(path)) as source:
        yield plan, mesh, source


def process_of(device) -> int:
    return device.id // 2  # 4 processes of 2 devices


def test_remote_column_reads_become_band_reads_at_their_ideal_share(column_split):
    plan, mesh, source = column_split
    reader = RemoteReader(source)
    chosen = choose_read_shardings(plan.leaves, reader, "auto", process_of=process_of, platform="cpu")
    assert "layers.attn.q.kernel" in chosen and "layers.mlp.gate.kernel" in chosen  # column blocks
    assert "layers.mlp.down.kernel" not in chosen  # its rows are split already: read in place
    mine = process_devices(mesh, process_of)[0]
    for path, p in plan.leaves.items():
        read = p.device_boxes(mine, chosen[path].sharding if path in chosen else None)
        fetched, requests = leaf_planned(p, read, reader)
        assert fetched <= 1.25 * p.ideal_bytes(mine), path
        direct = leaf_planned(p, p.device_boxes(mine), reader)
        assert path not in chosen or requests < direct[1] / 10  # a request per row, avoided


def test_cold_local_column_reads_become_bands_and_warm_ones_stay_in_place(column_split):
    """Issue 34: on a cold disk each process fetches about its share (column blocks read as bands);
    on a warm page cache (agreed by every process) the copy from it beats a reshard over Gloo. The
    choice is a pure function of its inputs: asked twice, the same answer."""
    plan, mesh, source = column_split
    reader = TensorReader(source)
    cold = choose_read_shardings(plan.leaves, reader, "auto", process_of=process_of, platform="cpu", cold=True)
    assert {"layers.attn.q.kernel", "layers.mlp.gate.kernel", "layers.mlp.up.kernel"} <= set(cold)
    assert cold == choose_read_shardings(plan.leaves, reader, "auto", process_of=process_of, platform="cpu")
    groups = process_devices(mesh, process_of)
    for g in groups:
        mine = groups[g]
        fetched = sum(leaf_planned(p, p.device_boxes(mine, cold[path].sharding if path in cold else None), reader)[0]
                      for path, p in plan.leaves.items())  # fmt: skip
        direct = sum(leaf_planned(p, p.device_boxes(mine), reader)[0] for p in plan.leaves.values())
        ideal = sum(p.ideal_bytes(mine) for p in plan.leaves.values())
        assert fetched <= 1.25 * ideal < 1.5 * ideal < direct, (g, fetched / ideal, direct / ideal)
    warm = choose_read_shardings(plan.leaves, reader, "auto", process_of=process_of, platform="cpu", cold=False)
    assert warm == {}  # 0.5 MiB leaves: a page-cache copy takes less than one collective's fixed 10 ms


def test_policies_and_one_process_keep_direct_reads(column_split):
    plan, mesh, source = column_split
    reader = RemoteReader(source)
    assert choose_read_shardings(plan.leaves, reader, "never", process_of=process_of) == {}
    assert choose_read_shardings(plan.leaves, reader, "auto") == {}  # one process: all boxes are local
    everything = choose_read_shardings(plan.leaves, reader, "always", process_of=process_of)
    assert set(choose_read_shardings(plan.leaves, reader, "auto", process_of=process_of)) <= set(everything)
    with pytest.raises(ValueError, match="reshard="):
        choose_read_shardings(plan.leaves, reader, "sometimes")


def test_the_time_model_weighs_the_reshard_against_the_bytes_saved(column_split):
    plan, mesh, source = column_split
    groups = process_devices(mesh, process_of)
    q = plan.leaves["layers.attn.q.kernel"]
    reader = TensorReader(source)  # local pages: direct reads fetch whole rows, cheaply
    slow = TimeModel(source_bandwidth=1e12, request_seconds=0.0, interconnect_bandwidth=1e9)
    fast = TimeModel(source_bandwidth=1e6, request_seconds=0.0, interconnect_bandwidth=1e12)
    assert choose_leaf(q, reader, groups, slow, "auto").sharding is None  # reading is free, resharding not
    band = choose_leaf(q, reader, groups, fast, "auto")
    assert isinstance(band.sharding, NamedSharding) and band.band_bytes < band.direct_bytes / 2
    assert band.sharding.spec != PartitionSpec(None, None, None, "fsdp")
