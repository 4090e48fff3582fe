"""Each byte from the source once, cluster-wide (issue 17 §2), from the plan alone: on a mesh that
leaves some leaves whole on several processes, the read layouts ``always`` picks make all processes
together fetch the checkpoint once, and ``auto`` picks them where the interconnect is fast enough.
The processes are simulated (``process_of``: 4 processes × 2 of the 8 CPU devices); the real
4-process loads and their ``/proc/self/io`` are in tests/multihost/test_fetch.py."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import otfload
from benchmarks.make_checkpoint import Dims, write_checkpoint
from otfload.place.collective_route import TimeModel, choose_leaf, choose_read_shardings, process_devices
from otfload.read.planned import leaf_planned
from otfload.read.reader import TensorReader

# 4 KV heads of 128 do not split over tp=8: k and v are replicated on every process (their embed dim
# has no fsdp axis on this mesh). bf16 rows of 1 KiB.
DIMS = Dims(hidden=512, intermediate=1408, layers=2, vocab=4096)
ONCE = 1.05


def process_of(device) -> int:
    return device.id // 2


@pytest.fixture(scope="module")
def tp8(tmp_path_factory):
    path: Path = write_checkpoint(tmp_path_factory.mktemp("once") / "llama", DIMS, shard_bytes=8 * 10**6)
    mesh = Mesh(np.array(sorted(jax.devices(), key=lambda d: d.id)), ("tp",))
    _, plan, source = otfload.plan_model(path, mesh=mesh)
    yield plan, mesh, source, sum(p.stat().st_size for p in path.glob("*.safetensors"))
    source.close()


def cluster_bytes(plan, mesh, reader, shardings: dict) -> int:
    """Bytes all 4 processes fetch for ``plan``, each leaf read in ``shardings[path]`` (default: its own)."""
    groups = process_devices(mesh, process_of)
    return sum(
        leaf_planned(p, p.device_boxes(groups[g], shardings.get(path)), reader)[0]
        for path, p in plan.leaves.items() for g in groups
    )  # fmt: skip


def test_always_reads_the_checkpoint_once_across_processes(tp8):
    plan, mesh, source, size = tp8
    reader = TensorReader(source)
    k = plan.leaves["layers.attn.k.kernel"]
    assert k.leaf.sharding.spec == PartitionSpec() or all(a is None for a in k.leaf.sharding.spec)  # replicated
    in_place = cluster_bytes(plan, mesh, reader, {})
    chosen = choose_read_shardings(plan.leaves, reader, "always", process_of=process_of)
    once = cluster_bytes(plan, mesh, reader, {path: c.sharding for path, c in chosen.items()})
    assert {"layers.attn.k.kernel", "layers.attn.v.kernel"} <= set(chosen)
    assert once <= ONCE * size < 1.5 * size < in_place, (once / size, in_place / size)
    for path in ("layers.attn.k.kernel", "layers.attn.v.kernel"):  # each process a distinct quarter
        groups = process_devices(mesh, process_of)
        boxes = [plan.leaves[path].device_boxes(groups[g], chosen[path].sharding) for g in groups]
        flat = [b for bs in boxes for b in bs]
        assert len(set(flat)) == len(flat) == 8


def test_auto_reads_a_shared_leaf_once_only_where_the_interconnect_pays_for_it(tp8):
    plan, mesh, source, _ = tp8
    groups = process_devices(mesh, process_of)
    k = plan.leaves["layers.attn.k.kernel"]
    reader = TensorReader(source)
    # Each process reads the whole 1 MiB leaf in place; a band is a quarter, then an all-gather (10 ms
    # fixed). A fast source and a slow interconnect keep direct reads; a shared slow store and a fast
    # interconnect read the leaf once.
    slow = TimeModel(source_bandwidth=1e10, request_seconds=0.0, interconnect_bandwidth=1e8)
    fast = TimeModel(source_bandwidth=1e7, request_seconds=0.0, interconnect_bandwidth=1e11)
    assert choose_leaf(k, reader, groups, slow, "auto").sharding is None
    band = choose_leaf(k, reader, groups, fast, "auto")
    assert isinstance(band.sharding, NamedSharding)
    # A quarter each (plus a page at each unaligned run's end): the leaf is read once in all.
    assert band.band_bytes < band.direct_bytes / 3
