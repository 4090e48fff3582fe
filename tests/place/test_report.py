"""The load report counts what the source really fetched, and the plan says it beforehand.

``bytes_read`` and ``requests`` are counted by the sources where they fetch (preadv calls, mapped
ranges prefetched, HTTP requests); ``bytes_planned`` is computed from the plan without reading. On
one process they must agree for every family, and every checkpoint byte is fetched once — DeepSeek's
``kv_b_proj`` included, whose two leaves each read only their rows. The counts are checked against
what really moved: the bytes the Hub server sent, and the kernel's ``/proc/self/io`` for cold files.
"""

from __future__ import annotations

import os
from contextlib import closing
from pathlib import Path

import numpy as np
import pytest

import otfload
from otfload.accounting.meter import FetchMeter, metering
from otfload.index.checkpoint import open_index
from otfload.place.loader import execute_plan
from otfload.plan.boxes import box_to_slices
from otfload.plan.sharding import make_mesh
from otfload.read.arena import Arena
from otfload.read.reader import TensorReader
from otfload.sources import LocalSource, open_source
from tests.families.moe_helpers import MESHES
from tests.helpers import evict, hf_tensors
from tests.synthetic import write_checkpoint

# Tiny checkpoints of every family: kind -> mesh (MoE experts split on "ep" where the family has them).
KINDS = {
    "llama": MESHES["fsdp2_tp4"],
    "gemma2": MESHES["fsdp2_tp4"],
    "mixtral": MESHES["fsdp2_ep4"],
    "qwen3_moe": MESHES["fsdp2_ep4"],
    "deepseek_v2": MESHES["fsdp2_tp4"],
    "deepseek_v3": MESHES["fsdp2_ep4"],
    "gpt_oss": MESHES["fsdp2_ep4"],
}


@pytest.fixture(scope="module", autouse=True)
def _register_kinds():
    import tests.families.test_deepseek  # noqa: F401  (register the tiny model kinds)
    import tests.families.test_gemma  # noqa: F401
    import tests.families.test_gpt_oss  # noqa: F401
    import tests.families.test_mixtral  # noqa: F401
    import tests.families.test_qwen3_moe  # noqa: F401


def shared_bytes(plan) -> int:
    """Bytes of the tensors several leaves read parts of (on a mapped file, a page holding both parts
    is fetched by each)."""
    uses: dict = {}
    for p in plan.leaves.values():
        for info in p.sources:
            uses.setdefault(info.name, []).append(info.nbytes)
    return sum(sizes[0] for sizes in uses.values() if len(sizes) > 1)


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "preadv"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_one_process_fetches_what_was_planned_and_each_byte_once(tiny_checkpoints, kind, mmap):
    path, _ = tiny_checkpoints(kind)
    mesh = make_mesh(KINDS[kind])
    _, plan, src = otfload.plan_model(LocalSource(path, mmap=mmap), mesh=mesh)
    with closing(src):  # the caller's source: the load leaves it open
        _, report = otfload.from_pretrained(src, mesh=mesh, return_report=True)
    assert report.bytes_read == report.bytes_planned > 0
    assert report.bytes_ideal <= report.bytes_needed <= report.bytes_read
    assert report.requests > 0
    once = plan.source_bytes  # each tensor once, however many leaves use it
    assert report.bytes_needed == once  # the leaves' own bytes: every byte once, pages aside
    # Whole pages: a page holding rows of two leaves is fetched for each — but GPT-OSS's gate and up
    # (a strided slice's siblings) split the pages of gate_up_proj, which the disk serves once.
    assert once <= report.bytes_read <= once + shared_bytes(plan)
    assert report.bytes_read == once or kind.startswith("deepseek")
    assert report.bytes_ideal == once  # one process holds every element
    assert report.over_read == 1.0 or kind.startswith("deepseek")


def test_deepseek_fused_tensors_are_counted_once(tiny_checkpoints):
    path, _ = tiny_checkpoints("deepseek_v3")
    _, plan, src = otfload.plan_model(path, mesh=make_mesh(MESHES["fsdp2_tp4"]))
    src.close()
    fused = [i for p in plan.leaves.values() for i in p.sources if i.name.endswith(("kv_b_proj.weight", "mqa.weight"))]
    assert len(fused) == 2 * len({i.name for i in fused})  # kv_a → kv_a + k_rope, kv_b → k_b + v_b
    per_leaf = sum(p.source_bytes for p in plan.leaves.values())
    assert plan.source_bytes == per_leaf - sum(i.nbytes for i in fused) // 2
    checkpoint = sum(v.nbytes for v in hf_tensors(path).values())
    assert plan.source_bytes == checkpoint  # every tensor is used, once


def test_fp8_deepseek_reads_each_kv_b_block_once(tiny_checkpoints, tmp_path):
    from tests.index.quant import layouts

    src, _ = tiny_checkpoints("deepseek_v3")
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}
    layouts.quantize_checkpoint(src, tmp_path / "fp8", layouts.is_linear, layouts.fp8_blocks((16, 16)), config)
    mesh = make_mesh(MESHES["fsdp2_tp4"])
    _, plan, source = otfload.plan_model(LocalSource(tmp_path / "fp8", mmap=False), mesh=mesh)
    with closing(source):
        model, report = otfload.from_pretrained(source, mesh=mesh, return_report=True)
    assert report.bytes_read == report.bytes_planned
    # Every code once (kv_b's rows split between k_b and v_b); kv_b's 4-byte scale rows are too small to
    # read apart (MIN_SELECTION_RUN_BYTES): each leaf fetches them all, but needs only its own.
    assert report.bytes_needed == plan.source_bytes
    reference = otfload.from_pretrained(tmp_path / "fp8", mesh=mesh)  # mapped: other read path
    for layer in range(2):
        got = np.asarray(model.moe_layers.attn.k_b.kernel[...])[layer]
        np.testing.assert_array_equal(got, np.asarray(reference.moe_layers.attn.k_b.kernel[...])[layer])


def test_report_matches_the_bytes_and_requests_the_hub_served(hub, tiny_checkpoints, tmp_path, mesh_2x4, request):
    from otfload.sources.retry import RetryPolicy
    from tests.multihost.conftest import FAST_RETRY

    path, _ = tiny_checkpoints("llama")
    repo = hub.add_repo("org/report-llama", path)
    source = open_source(repo, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=RetryPolicy(**FAST_RETRY))
    request.addfinalizer(source.close)
    _, plan, _ = otfload.plan_model(source, mesh=mesh_2x4)  # headers: before the count starts
    hub.reset()
    _, report = execute_plan(plan, source, workers=4)
    gets = hub.requests("GET", "/resolve/")
    assert report.bytes_read == hub.body_bytes  # every byte the server sent, gaps merged included
    assert report.requests == len(gets)
    assert report.bytes_planned <= report.bytes_read <= 1.1 * report.bytes_planned


# --- against the kernel: /proc/self/io read_bytes for cold files ---------------------------------------


def disk_read_bytes() -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    raise AssertionError("no read_bytes in /proc/self/io")



@pytest.fixture(scope="module")
def big_matrix(tmp_path_factory) -> tuple[Path, np.ndarray]:
    """One 2048 x 8192 float32 tensor (rows of 32 KiB), alone in its file."""
    data = np.random.default_rng(3).standard_normal((2048, 8192), dtype=np.float32)
    path = write_checkpoint(tmp_path_factory.mktemp("big") / "c", {"w": data}, files=1)
    file = next(path.glob("*.safetensors"))
    evict(file)
    fd = os.open(file, os.O_RDONLY)
    try:
        before = disk_read_bytes()
        os.pread(fd, 4096, 1 << 20)
        if disk_read_bytes() == before:
            pytest.skip("this filesystem does not account reads in /proc/self/io (tmpfs?)")
    finally:
        os.close(fd)
    return path, data


@pytest.mark.parametrize("mmap", [True, False], ids=["mmap", "preadv"])
@pytest.mark.parametrize("box", [((0, 2048), (2048, 4096)), ((512, 1024), (0, 8192)), ((0, 2048), (0, 8192))],
                         ids=["column-block", "row-band", "whole"])
def test_counted_bytes_are_the_bytes_the_kernel_read(big_matrix, box, mmap, request):
    path, data = big_matrix
    index = open_index(LocalSource(path, mmap=mmap), require_config=False)
    request.addfinalizer(index.source.close)
    reader, meter = TensorReader(index.source), FetchMeter()
    evict(next(path.glob("*.safetensors")))
    before = disk_read_bytes()
    with metering(meter):
        got = reader.read_box(index["w"], box, Arena())
        np.testing.assert_array_equal(got, data[box_to_slices(box)])
    kernel = disk_read_bytes() - before
    wanted = data[box_to_slices(box)].nbytes
    assert meter.bytes == reader.planned(index["w"], box)[0]
    # whole pages: a band ends on a page boundary at worst; an unaligned 8 KiB run touches 3 pages
    assert wanted <= meter.bytes <= (wanted + 2 * 4096 if box[1] == (0, 8192) else 1.5 * wanted)
    assert abs(kernel - meter.bytes) <= 0.05 * meter.bytes, (kernel, meter.bytes)  # no read-around
