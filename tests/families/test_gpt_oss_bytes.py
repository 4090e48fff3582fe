"""GPT-OSS's interleaved MXFP4 ``gate_up_proj``: each of the ``gate`` and ``up`` leaves needs only its
own rows, the two count each shared page once, and the values stay bit-exact.

The checkpoint has GPT-OSS-120B's row size: hidden 2880, so a row of ``gate_up_proj_blocks``
``[E, 2 * inter, 90, 16]`` is 1,440 bytes and a 4 KiB page holds rows of both leaves (gate even,
up odd). References are independent: numpy masks over the stored blocks for the bytes a shard
needs, the safetensors package and transformers' MXFP4 dequantisation for the values, and the
kernel's ``/proc/self/io`` for what a cold read really fetched.
"""

from __future__ import annotations

import math
import os
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

import otfload
from otfload.accounting.meter import FetchMeter, metering
from otfload.cli.inspect import process_devices
from otfload.index.quant.codes import MX_BLOCK, MX_BLOCK_BYTES
from otfload.place.builder import build_boxes
from otfload.place.collective_route import band_shardings
from otfload.plan.leaf_bytes import leaf_needed
from otfload.plan.sharding import make_mesh
from otfload.read.arena import Arena
from otfload.read.planned import leaf_planned
from otfload.read.reader import TensorReader
from otfload.sources import LocalSource
from tests.helpers import evict, hf_tensors, memory_copy, register_hf_model

HIDDEN, INTER, EXPERTS, LAYERS = 2880, 64, 4, 3
MESHES = {"fsdp2_tp4": {"fsdp": 2, "tp": 4}, "fsdp2_ep4": {"fsdp": 2, "ep": 4}, "fsdp8": {"fsdp": 8}}
GATE_UP = "model.layers.{layer}.mlp.experts.gate_up_proj"


@pytest.fixture(scope="module")
def wide(tiny_checkpoints, tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """``(checkpoint dir, {HF key: float32 reference})``: a GPT-OSS of hidden 2880, experts in MXFP4."""
    from tests.families.test_gpt_oss import _gpt_oss
    from tests.index.quant import layouts

    register_hf_model("gpt_oss_wide", _gpt_oss, {"hidden_size": HIDDEN, "intermediate_size": INTER,
                                                 "num_hidden_layers": LAYERS, "num_local_experts": EXPERTS})
    src, _ = tiny_checkpoints("gpt_oss_wide")
    dst = tmp_path_factory.mktemp("gpt_oss_wide") / "mxfp4"
    reference = layouts.quantize_checkpoint(src, dst, layouts.is_gpt_oss_expert, layouts.mxfp4_experts,
                                            layouts.MXFP4_CONFIG)
    return dst, reference


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "preadv"])
@pytest.mark.parametrize("mesh_name", ["fsdp2_tp4", "fsdp2_ep4"])
def test_gate_and_up_are_bit_exact_and_read_once(wide, mesh_name, mmap):
    path, reference = wide
    mesh = make_mesh(MESHES[mesh_name])
    _, plan, src = otfload.plan_model(LocalSource(path, mmap=mmap), mesh=mesh, scan_layers=False)
    with closing(src):  # the caller's source: the load leaves it open
        model, report = otfload.from_pretrained(src, mesh=mesh, dtype="float32", scan_layers=False,
                                                return_report=True)
    hf = hf_tensors(path)
    for layer in range(LAYERS):
        fused = reference[GATE_UP.format(layer=layer)]
        bias = hf[GATE_UP.format(layer=layer) + "_bias"]
        moe = model.layers[layer].moe
        np.testing.assert_array_equal(np.asarray(moe.gate.kernel[...]), fused[..., ::2])
        np.testing.assert_array_equal(np.asarray(moe.up.kernel[...]), fused[..., 1::2])
        np.testing.assert_array_equal(np.asarray(moe.gate.bias[...]), bias[..., ::2])
        np.testing.assert_array_equal(np.asarray(moe.up.bias[...]), bias[..., 1::2])
    # One process holds everything: each stored byte is needed once and fetched once — gate and up
    # each count their share of the pages they both read, not every page twice.
    assert report.bytes_read == report.bytes_planned
    assert report.bytes_needed == plan.source_bytes == report.bytes_ideal
    assert abs(report.bytes_read - plan.source_bytes) <= report.tensors_read  # each share rounded to a byte


def needed_by_numpy(boxes, leaf: str, stacked: bool) -> int:
    """Stored bytes of ``gate_up_proj`` (blocks + scales) the ``boxes`` of the gate or up kernel
    ``[(L,) E, in, inter]`` need, counted on a mask of the blocks' ``[L, E, 2 * inter, groups]``
    grid (one 16-byte block and one scale byte per cell)."""
    groups = HIDDEN // MX_BLOCK
    mask = np.zeros((LAYERS, EXPERTS, 2 * INTER, groups), bool)
    offset = 0 if leaf == "gate" else 1
    for box in boxes:
        (l0, l1), *rest = box if stacked else ((0, LAYERS), *box)
        (e0, e1), (i0, i1), (o0, o1) = rest
        mask[l0:l1, e0:e1, 2 * o0 + offset : 2 * o1 + offset : 2, i0 // MX_BLOCK : -(-i1 // MX_BLOCK)] = True
    return int(mask.sum()) * (MX_BLOCK_BYTES + 1)


@pytest.mark.parametrize("mesh_name", list(MESHES))
@pytest.mark.parametrize("processes", [2, 4, 8])
def test_each_process_needs_only_its_own_rows(wide, mesh_name, processes):
    path, _ = wide
    mesh = make_mesh(MESHES[mesh_name])
    _, plan, src = otfload.plan_model(path, mesh=mesh, scan_layers=True)
    src.close()
    for leaf in ("gate", "up"):
        p = plan.leaves[f"layers.moe.{leaf}.kernel"]
        for index in range(processes):
            devices, _ = process_devices(mesh, index, processes)
            assert p.process_bytes(devices) == needed_by_numpy(p.device_boxes(devices), leaf, stacked=True)
            for sharding in band_shardings(p.leaf):  # every read band the reshard time model weighs
                boxes = p.device_boxes(devices, sharding)
                assert leaf_needed(p, boxes) == needed_by_numpy(boxes, leaf, stacked=True), (leaf, index, sharding)
            # Against the ideal (the elements held, each once): MX groups of 32 input rows are the
            # granularity — at most one group more per side of a split of the 2,880 inputs.
            held = p.ideal_bytes(devices)
            split = max(b[2][1] - b[2][0] for b in p.device_boxes(devices))
            assert held <= p.process_bytes(devices) <= held * (1 + 2 * MX_BLOCK / split)


def disk_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "preadv"])
def test_shared_pages_are_counted_once_as_the_kernel_reads_them(wide, mmap):
    """Process 0 of 2 reads a band of ``gate`` and ``up`` output columns (full 1,440-byte rows, every
    other one): together they count the band's pages once, the kernel reads them once, and each
    leaf is charged about half."""
    from jax.sharding import NamedSharding, PartitionSpec

    path, reference = wide
    mesh = make_mesh(MESHES["fsdp8"])
    _, plan, src = otfload.plan_model(LocalSource(path, mmap=mmap), mesh=mesh, scan_layers=False)
    devices, _ = process_devices(mesh, 0, 2)
    reader = TensorReader(src)
    files = sorted(Path(path).glob("*.safetensors"))
    for file in files:
        evict(file)
    fd = os.open(files[0], os.O_RDONLY)
    try:
        probe = disk_read_bytes()
        os.pread(fd, 4096, 0)
        if disk_read_bytes() == probe:
            pytest.skip("this filesystem does not account reads in /proc/self/io (tmpfs?)")
    finally:
        os.close(fd)
    for file in files:
        evict(file)
    counted, planned, ideal = {}, {}, {}
    before = disk_read_bytes()
    with closing(src):
        for leaf in ("gate", "up"):
            p = plan.leaves[f"layers.1.moe.{leaf}.kernel"]
            band = NamedSharding(mesh, PartitionSpec(None, None, "fsdp"))  # output columns: full rows
            boxes = p.device_boxes(devices, band)
            meter = FetchMeter()
            with metering(meter):
                built = build_boxes(p, boxes, reader, Arena())
            counted[leaf], planned[leaf] = meter.bytes, leaf_planned(p, boxes, reader)[0]
            ideal[leaf] = needed_by_numpy([((1, 2), *b) for b in boxes], leaf, stacked=True)
            fused = reference[GATE_UP.format(layer=1)][..., 0 if leaf == "gate" else 1 :: 2]
            for box, values in built.items():
                np.testing.assert_array_equal(values, fused[tuple(slice(a, b) for a, b in box)])
    kernel = disk_read_bytes() - before
    assert counted == planned
    both = sum(ideal.values())  # the band's rows of both leaves: whole pages of the tensor
    page = 4096
    # whole pages: one at each end of each expert's band of blocks and of scales
    assert both <= sum(counted.values()) <= both + 4 * page * EXPERTS
    assert abs(kernel - sum(counted.values())) <= 0.05 * kernel, (kernel, counted)
    for leaf in counted:  # each is charged its own half, not every page
        assert counted[leaf] <= 0.55 * both
    assert math.isclose(counted["gate"], counted["up"], rel_tol=0.05)


def test_remote_reads_of_interleaved_rows_span_the_siblings(wide):
    """From a remote store (fsspec memory://: ranges, no pages), ``gate`` and ``up`` each read their
    rows' span — the sibling's rows between them included, so each stored byte of ``gate_up_proj``
    is fetched twice — instead of one range per 1,440-byte row."""
    import fsspec

    path, reference = wide
    url = memory_copy(path, "gpt-oss")
    mesh = make_mesh(MESHES["fsdp2_tp4"])
    model, report = otfload.from_pretrained(url, mesh=mesh, dtype="float32", scan_layers=False, return_report=True)
    for layer in range(LAYERS):
        fused = reference[GATE_UP.format(layer=layer)]
        moe = model.layers[layer].moe
        np.testing.assert_array_equal(np.asarray(moe.gate.kernel[...]), fused[..., ::2])
        np.testing.assert_array_equal(np.asarray(moe.up.kernel[...]), fused[..., 1::2])
    interleaved = sum(v.nbytes for k, v in hf_tensors(path).items() if "gate_up_proj_" in k and "bias" not in k)
    rows = LAYERS * EXPERTS * 2 * INTER * 2  # blocks and scales, one range each if read row by row
    assert report.requests < rows / 20
    assert report.bytes_read == report.bytes_planned
    assert report.bytes_read <= report.bytes_needed + interleaved + 64 * report.tensors_read
    fsspec.filesystem("memory").rm(url, recursive=True)
