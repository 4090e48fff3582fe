"""The ways of getting one checkpoint onto one set of shardings that the load benchmark compares.

Each method is ``prepare(target) -> run``: ``prepare`` does the untimed set-up (imports, abstract
trees), ``run()`` is timed and returns what it loaded (kept alive while memory is measured) and a
dict of extra figures. Every method loads exactly the leaves of ``target.plan`` onto their
``NamedSharding`` s, except the raw floor (bytes only) and Orbax (the HF tensors unstacked, no hooks,
on the matching shardings).
"""

from __future__ import annotations

import math
import os
import subprocess
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from safetensors.numpy import load_file

from benchmarks.target import Target
from otfload.plan.hooks import Hook, Reshape, Scale, Slice, Transpose, reshape_groups, run_forward
from otfload.plan.planner import LeafPlan

Run = Callable[[], tuple[Any, dict]]
FLOOR_CHUNK_BYTES = 64 * 2**20
# O_DIRECT requests: large enough that a request's fixed cost is small beside its transfer, several in
# flight so the device queue stays full (a single 16-64 MiB stream measured 2.0-2.2 s for 1.1 GB here,
# 4x slower than buffered reads with the kernel's read-ahead, docs/benchmarks.md "Cold page cache").
DIRECT_CHUNK_BYTES = 16 * 2**20


def _files(target: Target) -> list[str]:
    return sorted({info.file for lp in target.plan.leaves.values() for info in lp.sources})


def _read_chunk(path: str, offset: int, out: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        f.seek(offset)
        while out:
            n = f.readinto(out)
            if not n:
                raise EOFError(f"{path} ended early")
            out = out[n:]


def _chunk_jobs(path: str, buf: np.ndarray) -> list[tuple[str, int, memoryview]]:
    """``(path, offset, destination)`` for each :data:`FLOOR_CHUNK_BYTES` chunk of a file read into ``buf``."""
    return [(path, o, memoryview(buf)[o : o + FLOOR_CHUNK_BYTES]) for o in range(0, len(buf), FLOOR_CHUNK_BYTES)]


def floor(target: Target, threads: int = 2) -> Run:
    """Raw floor: every byte of every checkpoint file ``readinto`` fresh numpy memory (no JAX).

    Files are split into 64 MiB chunks read by ``threads`` threads, as a loader with that many
    workers could at best.
    """
    paths = [str(target.directory / f) for f in _files(target)]

    def run():
        buffers, jobs = [], []
        for path in paths:
            with open(path, "rb") as f:
                size = f.seek(0, 2)
            buf = np.empty(size, np.uint8)
            buffers.append(buf)
            jobs += _chunk_jobs(path, buf)
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda job: _read_chunk(*job), jobs))
        return buffers, {"threads": threads}

    return run


def floor_1thread(target: Target) -> Run:
    """The raw floor with one reader thread."""
    return floor(target, threads=1)


def fromfile(target: Target) -> Run:
    """``np.fromfile`` of every checkpoint file, one after another, into fresh memory."""
    paths = [str(target.directory / f) for f in _files(target)]

    def run():
        return [np.fromfile(path, np.uint8) for path in paths], {}

    return run


def _command(argv_of: Callable[[list[str]], list[list[str]]]) -> Callable[[Target], Run]:
    """A floor that runs shell commands over the checkpoint files (their bytes go to /dev/null)."""

    def prepare(target: Target) -> Run:
        paths = [str(target.directory / f) for f in _files(target)]

        def run():
            for argv in argv_of(paths):
                subprocess.run(argv, stdout=subprocess.DEVNULL, check=True)
            return None, {}

        return run

    return prepare


# ``cat`` of every file: the kernel's sequential read-ahead at its best, nothing kept.
cat = _command(lambda paths: [["cat", *paths]])
# ``dd`` of each file in DD_BLOCK-sized reads (16 MiB: larger blocks measured no faster here).
DD_BLOCK = "16M"
dd = _command(lambda paths: [["dd", f"if={p}", "of=/dev/null", f"bs={DD_BLOCK}", "status=none"] for p in paths])


def _load_all(target: Target) -> dict[str, np.ndarray]:
    state: dict[str, np.ndarray] = {}
    for file in _files(target):
        state.update(load_file(str(target.directory / file)))
    return state


def _hooked(lp: LeafPlan, state: dict[str, np.ndarray], i: int) -> np.ndarray:
    return run_forward(lp.hooks, state[lp.sources[i].name])


def naive(target: Target) -> Run:
    """``safetensors.numpy.load_file`` per file, numpy hooks per tensor, one ``np.stack``, ``device_put``."""

    def run():
        state = _load_all(target)
        leaves = target.plan.leaves.items()
        out = {path: jax.device_put(expected_leaf(lp, state), lp.leaf.sharding) for path, lp in leaves}
        jax.block_until_ready(out)
        return out, {}

    return run


def _full_spec(sharding: NamedSharding, ndim: int) -> list:
    spec = list(sharding.spec)
    return spec + [None] * (ndim - len(spec))


def loop(target: Target) -> Run:
    """The per-slice loop the seed started with: a zeros target made by ``jit(out_shardings=...)``,
    then ``stacked = stacked.at[i].set(device_put(slice))`` for every layer (and expert)."""

    def build_stacked(lp: LeafPlan, state: dict[str, np.ndarray]) -> jax.Array:
        leaf, n_stack = lp.leaf, len(lp.stack_axes)
        stacked = jax.jit(lambda: jnp.zeros(leaf.shape, leaf.dtype), out_shardings=leaf.sharding)()
        slice_spec = PartitionSpec(*_full_spec(leaf.sharding, len(leaf.shape))[n_stack:])
        slice_sharding = NamedSharding(leaf.sharding.mesh, slice_spec)
        for i in range(len(lp.sources)):
            position = tuple(jax.device_put(int(k)) for k in np.unravel_index(i, lp.stack_shape))
            piece = jax.device_put(_hooked(lp, state, i).astype(leaf.dtype), slice_sharding)
            stacked = stacked.at[position].set(piece)
        return stacked

    def run():
        state = _load_all(target)
        out = {}
        for path, lp in target.plan.leaves.items():
            if lp.stack_axes:
                out[path] = build_stacked(lp, state)
            else:
                out[path] = jax.device_put(_hooked(lp, state, 0).astype(lp.leaf.dtype), lp.leaf.sharding)
        jax.block_until_ready(out)
        return out, {}

    return run


def _spec_through(hook: Hook, out_spec: list, in_shape: tuple[int, ...], out_shape: tuple[int, ...]) -> list:
    """The spec of a hook's input that puts the same bytes on each device as ``out_spec`` of its output."""
    if isinstance(hook, Transpose):
        perm = hook.perm if hook.perm is not None else tuple(range(len(in_shape)))[::-1]
        spec = [None] * len(in_shape)
        for out_dim, in_dim in enumerate(perm):
            spec[in_dim] = out_spec[out_dim]
        return spec
    if isinstance(hook, Reshape):
        spec = [None] * len(in_shape)
        for gi, gj in reshape_groups(in_shape, out_shape):
            spec[gi[0]] = out_spec[gj[0]]
        return spec
    if isinstance(hook, Scale | Slice):
        return list(out_spec)
    return [None] * len(in_shape)


def source_sharding(lp: LeafPlan) -> NamedSharding:
    """A sharding of one HF tensor of ``lp`` matching one slice of the leaf's sharding."""
    sharding = lp.leaf.sharding
    spec = _full_spec(sharding, len(lp.leaf.shape))[len(lp.stack_axes) :]
    for hook, in_shape, out_shape in reversed(list(zip(lp.hooks, lp.shapes[:-1], lp.shapes[1:], strict=True))):
        spec = _spec_through(hook, spec, in_shape, out_shape)
    return NamedSharding(sharding.mesh, PartitionSpec(*spec))


def orbax(target: Target) -> Run:
    """Orbax v1's safetensors layout loading every HF tensor (no hooks, no stacking) onto
    :func:`source_sharding`."""
    from orbax.checkpoint import v1 as ocp

    abstract = {
        info.name: jax.ShapeDtypeStruct(info.shape, info.dtype, sharding=source_sharding(lp))
        for lp in target.plan.leaves.values()
        for info in lp.sources
    }

    def run():
        with ocp.Context(checkpoint_layout="safetensors"):
            tree = ocp.load(target.directory, abstract_state=abstract)
        jax.block_until_ready(tree)
        return tree, {"tensors": len(abstract)}

    return run


def otfload_load(target: Target) -> Run:
    """otfload's own route (``from_pretrained``, or ``load_params`` for a family it lacks)."""

    def run():
        start = time.perf_counter()
        loaded, report = target.load_otfload()
        planning = time.perf_counter() - start - report.seconds  # everything before the reads began
        extra = {
            "route": target.route,
            "load_seconds": report.seconds,
            "bytes_read": report.bytes_read,
            "requests": report.requests,
            "host_route": report.host_route,
            "first_leaf_seconds": planning + report.first_leaf_seconds,  # from the call to the first leaf
        }
        return loaded, extra

    return run


def otfload_no_read_ahead(target: Target) -> Run:
    """otfload with its cold-cache read-ahead thread off (``OTFLOAD_READ_AHEAD=0``): what it adds."""
    import os

    from otfload.read.readahead import READ_AHEAD_ENV

    os.environ[READ_AHEAD_ENV] = "0"  # this process runs this one method only
    return otfload_load(target)


def otfload_no_direct(target: Target) -> Run:
    """otfload with cold files read through the page cache like warm ones (``OTFLOAD_DIRECT_IO=0``):
    what ``O_DIRECT`` saves."""
    from otfload.read.reader import DIRECT_IO_ENV

    os.environ[DIRECT_IO_ENV] = "0"  # this process runs this one method only
    return otfload_load(target)


def otfload_hooks(where: str) -> Callable[[Target], Run]:
    """otfload with its hooks run on the device (``"always"``) or on the host (``"never"``) whatever the
    platform (``OTFLOAD_DEVICE_HOOKS``; default: on accelerators only)."""

    def prepare(target: Target) -> Run:
        from otfload.place.device_hooks import DEVICE_HOOKS_ENV

        os.environ[DEVICE_HOOKS_ENV] = where  # this process runs this one method only
        return otfload_load(target)

    return prepare


def otfload_fresh_buffers(target: Target) -> Run:
    """otfload with accelerators' host staging off (``builder.HOST_STAGING = False``): a fresh host
    buffer per shard, as for CPU devices — what the reused staging and as-read views save."""
    from otfload.place import builder

    builder.HOST_STAGING = False  # this process runs this one method only
    return otfload_load(target)


def otfload_whole_puts(target: Target) -> Run:
    """otfload with one ``device_put`` per accelerator shard (``put.DEVICE_PIECE_BYTES = None``),
    not in pieces."""
    from otfload.place import put

    put.DEVICE_PIECE_BYTES = None  # this process runs this one method only
    return otfload_load(target)


# --- accelerators (--platform gpu): the host-to-device copy and other loaders -----------------


def _sizes(target: Target) -> dict[str, int]:
    return {f: (target.directory / f).stat().st_size for f in _files(target)}


def _open_direct(path: str) -> tuple[int, bool]:
    """``path`` opened with ``O_DIRECT`` where its file system allows it, else buffered; whether direct."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECT), True
    except OSError:  # EINVAL: this file system does not do O_DIRECT
        return os.open(path, os.O_RDONLY), False


def direct(target: Target, threads: int | None = None, chunk: int = DIRECT_CHUNK_BYTES) -> Run:
    """Cold floor (issue 30 §4): every checkpoint byte read with ``O_DIRECT`` (the page cache neither
    read nor filled) in ``chunk``-byte block-aligned requests, ``threads`` (default: every CPU) in
    flight, into one page-aligned arena; buffered where the file system refuses ``O_DIRECT``."""
    from otfload.read.arena import aligned_empty

    sizes = _sizes(target)
    starts = dict(zip(sizes, np.cumsum([0, *[-(-n // 4096) * 4096 for n in sizes.values()]]), strict=False))
    arena = aligned_empty((int(sum(-(-n // 4096) * 4096 for n in sizes.values())),), np.uint8)

    def run():
        opened = {f: _open_direct(str(target.directory / f)) for f in sizes}
        jobs = [(f, o) for f, n in sizes.items() for o in range(0, n, chunk)]

        def read(job: tuple[str, int]) -> None:
            f, offset = job
            length = min(chunk, -(-(sizes[f] - offset) // 4096) * 4096)
            start = int(starts[f]) + offset
            os.preadv(opened[f][0], [memoryview(arena)[start : start + length]], offset)

        try:
            with ThreadPoolExecutor(threads or os.cpu_count() or 2) as pool:
                list(pool.map(read, jobs))
        finally:
            for fd, _ in opened.values():
                os.close(fd)
        return arena, {"o_direct": all(d for _, d in opened.values())}

    return run


def direct_disk_rate(target: Target) -> Run:
    """Issue 46's cold baseline, the disk's rate: :func:`direct` with 4 threads and 8 MiB requests."""
    return direct(target, threads=4, chunk=8 << 20)


def otfload_workers(n: int) -> Callable[[Target], Run]:
    """otfload with ``n`` builder threads for local files onto CPU devices (the default is 2)."""

    def setup(target: Target) -> Run:
        from otfload import opening

        opening.DEFAULT_WORKERS = n  # this process runs this one method only
        return otfload_load(target)

    return setup


def floor_all_threads(target: Target) -> Run:
    """The raw floor with one reader thread per CPU (the machine's warm read rate)."""
    return floor(target, threads=os.cpu_count() or 2)


def dma_put(target: Target) -> Run:
    """Limit of read + copy (issue 30): the files read (one thread per CPU) into one host arena
    registered with the accelerator's client for direct DMA (``dma_map``, at set-up), each file
    ``device_put`` from there as soon as it is read. Where registration is refused (CPU devices, a
    client without it) the same reads and puts run from unregistered memory, and the extras say so."""
    from otfload.read.arena import aligned_empty
    from otfload.read.pinned import DmaRegistry

    sizes = _sizes(target)
    device = target.mesh.devices.flat[0]
    arena = aligned_empty((sum(sizes.values()),), np.uint8)
    registry = DmaRegistry([device], ring_bytes=arena.nbytes)
    registry.register(arena)
    views, at = {}, 0
    for f, n in sizes.items():
        views[f], at = arena[at : at + n], at + n

    def run():
        placed = []
        with ThreadPoolExecutor(os.cpu_count() or 2) as pool:
            for f, view in views.items():
                list(pool.map(lambda job: _read_chunk(*job), _chunk_jobs(str(target.directory / f), view)))
                placed.append(jax.device_put(view, device))
        jax.block_until_ready(placed)
        return placed, {"dma": registry.describe()}

    return run


def otfload_primed(target: Target) -> Run:
    """otfload in a process that has made one small device transfer before (as a JAX program has by
    the time it loads weights): the runtime's one-time set-up is outside the timer."""
    for device in target.mesh.devices.flat:
        jax.device_put(np.zeros(1, np.uint8), device).block_until_ready()
    return otfload_load(target)


def otfload_staged(target: Target) -> Run:
    """otfload with no host ring (``OTFLOAD_HOST_RING_BYTES=0``): every shard through the runtime's
    staged copy, as before issue 30."""
    from otfload.read.pinned import HOST_RING_ENV

    os.environ[HOST_RING_ENV] = "0"  # this process runs this one method only
    return otfload_load(target)


def _file_bytes(target: Target) -> list[np.ndarray]:
    return [np.fromfile(str(target.directory / f), np.uint8) for f in _files(target)]


def pageable(target: Target) -> Run:
    """Copy ceiling from ordinary (pageable) host memory: the checkpoint's bytes, already read into
    numpy, ``jax.device_put`` onto the first device (no disk)."""
    data = _file_bytes(target)
    device = target.mesh.devices.flat[0]

    def run():
        placed = [jax.device_put(a, device) for a in data]
        jax.block_until_ready(placed)
        return placed, {}

    return run


def pinned(target: Target) -> Run:
    """Copy ceiling from page-locked host memory: the checkpoint's bytes, already in pinned torch
    buffers, copied to the GPU (no disk; torch, as JAX has no public pinned-host allocation from numpy)."""
    import torch

    data = [torch.from_numpy(a).pin_memory() for a in _file_bytes(target)]

    def run():
        placed = [t.to("cuda", non_blocking=True) for t in data]
        torch.cuda.synchronize()
        return placed, {}

    return run


def h2d(target: Target) -> Run:
    """Read then copy, one after the other: ``np.fromfile`` of every file, then ``jax.device_put``
    of its bytes (the serial floor a loader overlapping the two should beat)."""
    device = target.mesh.devices.flat[0]

    def run():
        start = time.perf_counter()
        data = _file_bytes(target)
        read = time.perf_counter() - start
        placed = [jax.device_put(a, device) for a in data]
        jax.block_until_ready(placed)
        return placed, {"read_seconds": read, "put_seconds": time.perf_counter() - start - read}

    return run


def _fastsafetensors_tensors(target: Target) -> dict[str, Any]:
    from fastsafetensors import fastsafe_open

    paths = [str(target.directory / f) for f in _files(target)]
    with fastsafe_open(paths, framework="pt", device="cuda:0", nogds=True) as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (fastsafe_open is no mapping)


def fastsafetensors(target: Target) -> Run:
    """fastsafetensors 0.5 (``fastsafe_open``, torch tensors on ``cuda:0``; ``nogds``: its own
    parallel reads into a pinned bounce buffer): every HF tensor as stored, no hooks, no stacking."""
    import torch

    def run():
        tensors = _fastsafetensors_tensors(target)
        torch.cuda.synchronize()
        return tensors, {}

    return run


def fastsafetensors_jax(target: Target) -> Run:
    """fastsafetensors, then each tensor into JAX by DLPack (no copy), the hooks and the stacking
    done on the GPU (``jnp.stack`` per leaf): the leaves otfload makes, by a GPU-side route."""
    import jax.numpy as jnp

    def run():
        tensors = _fastsafetensors_tensors(target)
        state = {name: jax.dlpack.from_dlpack(t) for name, t in tensors.items()}
        out = {}
        for path, lp in target.plan.leaves.items():
            pieces = [run_forward(lp.hooks, state[info.name]) for info in lp.sources]
            x = jnp.stack(pieces).reshape(lp.leaf.shape) if lp.stack_axes else pieces[0]
            out[path] = x.astype(lp.leaf.dtype)
        jax.block_until_ready(out)
        del state, tensors
        return out, {}

    return run


def expected_leaf(lp: LeafPlan, state: dict[str, np.ndarray]) -> np.ndarray:
    """A leaf's values by numpy alone: each HF tensor through the hooks, stacked, cast."""
    pieces = [_hooked(lp, state, i) for i in range(len(lp.sources))]
    x = np.stack(pieces).reshape(lp.leaf.shape) if lp.stack_axes else pieces[0]
    return x.astype(lp.leaf.dtype, copy=False)


def verify(target: Target) -> tuple[int, list[str]]:
    """Load with otfload and compare every leaf, bitwise, with :func:`expected_leaf`; returns the
    number of leaves compared and the paths that differ (or are missing)."""
    from otfload.export.gather import leaf_arrays

    loaded, _ = target.load_otfload()
    flat = leaf_arrays(loaded)
    state = _load_all(target)
    wrong = []
    for path, lp in target.plan.leaves.items():
        got = flat.get(path)
        if got is None or np.asarray(got).tobytes() != expected_leaf(lp, state).tobytes():
            wrong.append(path)
    return len(target.plan.leaves), wrong


METHODS: dict[str, Callable[[Target], Run]] = {
    "floor": floor,
    "floor1": floor_1thread,
    "fromfile": fromfile,
    "cat": cat,
    "dd": dd,
    "naive": naive,
    "loop": loop,
    "orbax": orbax,
    "otfload": otfload_load,
    "otfload-noahead": otfload_no_read_ahead,
    "otfload-nodirect": otfload_no_direct,
    "otfload-devhooks": otfload_hooks("always"),
    "otfload-hosthooks": otfload_hooks("never"),
    "otfload-fresh": otfload_fresh_buffers,
    "otfload-whole": otfload_whole_puts,
    "pageable": pageable,
    "pinned": pinned,
    "h2d": h2d,
    "fastsafetensors": fastsafetensors,
    "fst-jax": fastsafetensors_jax,
    "direct": direct,
    "direct4": direct_disk_rate,
    "otfload-w1": otfload_workers(1),
    "otfload-w3": otfload_workers(3),
    "otfload-w4": otfload_workers(4),
    "floor-all": floor_all_threads,
    "dma-put": dma_put,
    "otfload-primed": otfload_primed,
    "otfload-staged": otfload_staged,
}


def placed_bytes(tree: Any) -> int:
    """Bytes held by the addressable shards of every ``jax.Array`` (or numpy array) in ``tree``."""
    total = 0
    for leaf in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, np.ndarray | jax.Array)):
        if isinstance(leaf, jax.Array):
            total += sum(s.data.nbytes for s in leaf.addressable_shards)
        elif isinstance(leaf, np.ndarray):
            total += leaf.nbytes
        elif hasattr(leaf, "nbytes"):  # torch tensors (fastsafetensors)
            total += int(leaf.nbytes)
    return total


def largest_leaf_bytes(target: Target) -> int:
    return max(math.prod(lp.leaf.shape) * lp.leaf.dtype.itemsize for lp in target.plan.leaves.values())
