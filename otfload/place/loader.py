"""Execute a load plan: build every leaf (in parallel threads) and report what it cost.

The first leaf that fails for good cancels the load: leaves not started never start, and the running
ones stop at their next read (retries end, requests in flight are cut; see
:class:`~otfload.sources.retry.CancelToken`). That first error is raised, not the cancellations.

On a mesh of several processes the load first agrees with the others on what its choices read (the
plan, the policy, whether local files are cold: :mod:`otfload.place.agree`), chooses the leaves read
as bands from those agreed facts alone, compiles their reshard programs while the builders read, and
runs the reshards — collectives — only once every process has said it will run the same ones; a
failure here tells the others, so they end at once instead of waiting for it.
"""

from __future__ import annotations

import functools
import math
import sys
import threading
import time
from collections.abc import Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait

import jax
from tqdm.auto import tqdm

from otfload.accounting.meter import FetchMeter, metering
from otfload.coordination.agreement import DEFAULT_TIMEOUT_S
from otfload.errors import LoadCancelled
from otfload.place.agree import agree_load, is_cold
from otfload.place.builder import ByteBudget, build_leaf
from otfload.place.collective_route import (
    ReshardPrograms,
    choose_read_shardings,
    is_local,
    resolve_policy,
    route,
    with_sharding,
)
from otfload.place.device_hooks import compile_ahead
from otfload.place.report import LoadReport, current_rss, peak_rss
from otfload.plan.planner import LoadPlan
from otfload.plan.process_bytes import ideal_bytes
from otfload.read.arena import Arena
from otfload.read.direct_ahead import start_direct_ahead
from otfload.read.pinned import DmaRegistry
from otfload.read.planned import planned_bytes
from otfload.read.readahead import local_residency, start_read_ahead
from otfload.read.reader import TensorReader
from otfload.sources.base import Source
from otfload.sources.load_context import submit
from otfload.sources.retry import CancelToken, cancel_scope, current_token

# Two builders keep one core reading while the other copies; more only adds scratch memory on a
# 2-core host. Raise it for remote sources, where threads mostly wait on the network.
DEFAULT_WORKERS = 2
# Remote reads spend their time waiting on the network: 8 keep a bucket or the Hub busy (measured:
# 0.70x of gcsfs whole-file `cat` with 2 workers, 0.98x with 8, docs/benchmarks_remote.md).
REMOTE_WORKERS = 8
# Local files onto accelerators: a byte costs the host one copy (into registered staging; the hooks
# run on the device), which one thread does at a few GB/s, while the H200 host of issue 30 read the
# same files at 32.6 GB/s with 16 threads. Half the CPUs, at most this many (to be tuned on a GPU run).
ACCELERATOR_WORKERS = 8


def execute_plan(
    plan: LoadPlan,
    source: Source,
    *,
    workers: int = DEFAULT_WORKERS,
    host_memory_budget: int | None = None,
    progress: bool | None = None,
    reshard: str | None = None,
    host_ring_bytes: int | None = None,
    device_hooks: str = "auto",
    read_ahead: bool = True,
    direct_io: bool = True,
    collective_timeout: float = DEFAULT_TIMEOUT_S,
) -> tuple[dict[str, jax.Array], LoadReport]:
    """Build every leaf of ``plan`` from ``source``; returns ``{leaf path: array}`` and the report.

    ``host_memory_budget`` caps the scratch bytes (source data read but not yet placed) held by all
    builder threads together; the default, the largest leaf's source bytes, keeps transient host
    memory within one leaf. A smaller budget makes large stacked leaves build in several chunks.
    ``reshard`` says when a leaf may be read in its storage layout and moved to its sharding by a
    collective (see :mod:`otfload.place.collective_route`): ``"auto"`` (where the time model says it is
    faster), ``"always"`` (wherever it fetches fewer bytes: column-split leaves, and leaves several
    processes hold — each byte then read once cluster-wide) or ``"never"``; default ``"auto"``.
    ``host_ring_bytes``: on accelerators, the staging memory all builders keep registered for direct
    DMA together (:mod:`otfload.read.pinned`; default 1 GiB; 0: the runtime's staged copy).
    ``device_hooks``: where hooks run (:func:`~otfload.place.device_hooks.hooks_on_device`);
    ``read_ahead`` and ``direct_io``: whether cold local files are read ahead (into the page cache, or
    with ``O_DIRECT`` into a ring of half the budget, :mod:`otfload.read.direct_ahead`) and with ``O_DIRECT``;
    ``collective_timeout``: the bound of a multi-process load's exchanges and collectives. The
    options of a load give each of these (:class:`~otfload.options.LoadOptions`, the environment
    included); nothing here reads the environment.
    """
    largest = max((p.source_bytes for p in plan.leaves.values()), default=0)
    budget = ByteBudget(host_memory_budget or largest, workers)
    report = LoadReport(source=source.description, leaves=len(plan.leaves), rss_before=current_rss())
    reader = TensorReader(source)
    policy = resolve_policy(reshard)
    files = is_local(reader)
    residency = local_residency(reader)  # None: not known (read as cold)
    cold_files = None if residency is None else residency.cold
    agreement, agreed = agree_load(plan.leaves, policy, files, None if residency is None else residency.resident,
                                   collective_timeout)
    # The same choices on every process: a pure function of the plan, the policy and the agreed facts.
    chosen = choose_read_shardings(plan.leaves, reader, policy, cold=is_cold(agreed))
    bands = {path: c.sharding for path, c in chosen.items() if c.sharding is not None}
    report.route = route(policy, files, agreed.resident, chosen)
    programs = ReshardPrograms(plan.leaves, bands)  # compiled while the builders read
    direct = reader.use_direct(cold_files or ()) if direct_io else frozenset()  # cold files bypass the page cache
    rest = None if cold_files is None else cold_files - direct  # (O_DIRECT, read ahead into a ring of
    # scratch); the rest are read ahead into the page cache
    ahead = start_read_ahead(plan, reader, bands, rest) if read_ahead else None
    order = build_order(plan, reader, ahead is not None)
    direct_ahead = start_direct_ahead(plan, reader, order, budget.limit, bands, workers) if read_ahead else None
    if direct_ahead is not None:
        budget.set_aside(direct_ahead.ring_bytes)
    compiling = compile_ahead(plan.leaves.values(), device_hooks)  # device layouts compile while the bytes are read
    local = threading.local()
    registry = DmaRegistry(load_devices(plan), host_ring_bytes)  # accelerators: staging for direct DMA
    stagings: list[Arena] = []
    ring_share = registry.ring_bytes // max(1, workers)
    show = sys.stderr.isatty() if progress is None else progress
    total = sum(p.source_bytes for p in plan.leaves.values())
    bar = tqdm(total=total, unit="B", unit_scale=True, desc="otfload", disable=not show)
    start = time.perf_counter()

    token = CancelToken(current_token())  # a caller's token (e.g. a background load's) cancels it too
    meter = FetchMeter()  # what the source really fetches, counted where it fetches

    def build(path: str) -> jax.Array:
        if token.cancelled:  # queued before the first failure, picked up after it
            raise LoadCancelled(f"leaf {path!r}: cancelled, another leaf failed")
        if ahead is not None:
            ahead.started(path)
        try:
            if not hasattr(local, "arena"):
                local.arena, local.staging = Arena(), Arena(registry)
                stagings.append(local.staging)
            if registry.available:  # the builder's share of the host ring, registered once and kept;
                local.staging.trim(ring_share)  # a buffer an oversized shard grew goes back
                local.staging.reserve(ring_share, takes=0)
            leaf_plan = plan.leaves[path]
            if path in bands:
                leaf_plan = with_sharding(leaf_plan, bands[path])
            array = build_leaf(leaf_plan, reader, local.arena, budget, local.staging, device_hooks)
        except BaseException:
            token.cancel()  # at once, before this worker picks up a queued leaf
            raise
        bar.update(plan.leaves[path].source_bytes)
        report.first_leaf_seconds = report.first_leaf_seconds or time.perf_counter() - start
        return array

    pool = ThreadPoolExecutor(max(1, workers), thread_name_prefix="otfload-build")
    try:
        with cancel_scope(token), metering(meter):  # the load's context, which every builder runs in
            futures = {path: submit(pool, build, path) for path in order}
        wait(futures.values(), return_when=FIRST_EXCEPTION)
        if first_failure(futures.values()):
            pool.shutdown(wait=False, cancel_futures=True)  # leaves not started never start
            token.cancel()  # running ones stop at their next read, or mid-request
            pool.shutdown(wait=True)
            # Asked again once all stopped: the failing leaf cancels before it raises, so a leaf
            # cancelled by it can finish first; the real error is then known.
            failure = first_failure(futures.values())
            if agreement is not None and failure is not None:
                agreement.abort(failure)  # the others end at the reshard exchange instead of waiting
            raise failure  # type: ignore[misc]
        arrays = {path: futures[path].result() for path in plan.leaves}
        resharding = time.perf_counter()
        if agreement is not None:  # collectives: every process runs the same ones, in the plan's order
            agreement.before_collectives(list(bands))
            steps = [(path, functools.partial(programs.reshard, arrays[path], plan.leaves[path].leaf.sharding))
                     for path in bands]  # fmt: skip
            arrays.update(zip(bands, agreement.run(steps), strict=True))
        for array in arrays.values():
            array.block_until_ready()
        report.reshard_seconds = time.perf_counter() - resharding
    finally:
        token.cancel()  # a no-op after success; after an interrupt, stops what still runs
        if ahead is not None:
            ahead.close()
        if direct_ahead is not None:
            direct_ahead.close()
        programs.close()
        pool.shutdown(wait=True, cancel_futures=True)
        if compiling is not None:
            compiling.shutdown(wait=True, cancel_futures=True)
        for staging in stagings:  # every transfer from them has completed (leaves are ready)
            staging.close()
        registry.close()
        bar.close()
    report.seconds = time.perf_counter() - start
    stats = reader.stats
    report.tensors_read, report.bytes_needed = stats.pieces, stats.bytes_needed
    report.bytes_read, report.requests = meter.bytes, meter.requests
    report.files = sorted(stats.files)
    report.bytes_planned = planned_bytes(plan, reader, bands)
    report.resharded = list(bands)
    report.bytes_ideal = ideal_bytes(plan)
    report.bytes_placed = sum(placed_bytes(a) for a in arrays.values())
    report.unused_tensors = list(plan.unused)
    report.peak_rss = peak_rss()
    report.host_route = registry.describe()
    return arrays, report


def load_devices(plan: LoadPlan) -> list[jax.Device]:
    """This process's devices that ``plan``'s leaves are placed on."""
    return list({d: None for p in plan.leaves.values() for d in p.leaf.sharding.addressable_devices})


def build_order(plan: LoadPlan, reader: TensorReader, read_ahead: bool = False) -> list[str]:
    """The order ``plan``'s leaves go to the builders.

    Local files read ahead (``read_ahead``: a cold cache read through it): the plan's, the order the
    read-ahead announces (the disk then reads ascending runs). Otherwise (remote sources, warm or
    ``O_DIRECT`` local files) largest first, ties in the plan's order: each leaf is one builder's
    task, so a large leaf left to the end runs alone while the other builders idle; started first,
    the large leaves share the time with everything else and small ones end the load. Remote: on the
    shaped Hub of ``benchmarks/bench_network.py`` (556 MB, 8 builders) this took the median load
    from 2.75 s to 2.41-2.45 s (docs/benchmarks_remote.md). Warm local files (issue 46): the 1 GiB
    scanned Llama's last MLP kernel (0.13-0.16 CPU-s) and the tunix Qwen3 tree's ``lm_head`` (0.12
    CPU-s) ran alone after the other builder had run out of leaves.
    """
    if read_ahead and (reader.maps or reader.pages):
        return list(plan.leaves)
    return sorted(plan.leaves, key=lambda path: -plan.leaves[path].source_bytes)


def placed_bytes(array: jax.Array) -> int:
    """Bytes ``array`` holds on this process's devices (a replicated shard counts on each), from its
    sharding: asking for ``addressable_shards`` makes an array per shard (6 % of an unscanned load)."""
    shard = math.prod(array.sharding.shard_shape(array.shape)) * array.dtype.itemsize
    return shard * len(array.sharding.addressable_devices)


def first_failure(futures: Iterable[Future[jax.Array]]) -> BaseException | None:
    """The error of a finished future, preferring a real failure over a cancellation it caused."""
    errors = [f.exception() for f in futures if f.done() and not f.cancelled() and f.exception() is not None]
    real = [e for e in errors if not isinstance(e, LoadCancelled)]
    return (real or errors or [None])[0]
