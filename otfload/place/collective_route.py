"""Read in the storage's own layout, reshard on the devices.

A leaf whose target sharding splits its HF tensors' contiguous (column) axis across processes makes
each process read a column block: thousands of short runs, and — since the kernel and remote stores
fetch pages and ranges, not columns — most of every row (a 4 KiB page of a 4 KiB row holds every
process's columns). Instead such a leaf can be read as a *band*: the leaf sharded on one dimension
over all mesh axes, so that each process reads contiguous source rows (its 1/P share of the bytes,
as many as the ideal), then moved to its target ``NamedSharding`` with one collective
(``jax.device_put``) over the devices' interconnect.

The choice is made per leaf by :func:`choose_read_shardings` (policy ``"auto"``), by the source:

* **remote, or local files on a warm page cache**: a small time model (:class:`TimeModel`) — the time
  to fetch what each layout fetches (bytes over the source's bandwidth, plus a latency per request;
  a warm page cache is read at memory speed) against the band's fetch time plus the reshard (bytes
  moved over the interconnect, plus a fixed cost per collective);
* **local files on a cold page cache**: the disk is the scarce resource, as a remote store is — a
  leaf whose direct reads would fetch more than FETCH_TARGET times the bytes its devices hold is
  read as the band that fetches the fewest bytes; the time model may band others too.

The reshard programs are compiled ahead, while the bytes are read (:class:`ReshardPrograms`), so a
compile is no term of the choice. Direct reads are kept where they win: one process (every device's
box is local, the bounding box is the tensor), rows already split, replicated leaves.

Every process must make the same choices and run the reshards in the same order (they are
collectives): choices are a pure function of the plan, the mesh, the policy, the source kind and the
page cache's state *agreed* by all processes (:mod:`otfload.place.agree`), never of what one process
did before; :func:`~otfload.place.loader.execute_plan` runs them in plan order once every leaf is
built. The bytes each layout fetches come from the reader's own plan (pages of local files, merged
remote ranges: :meth:`~otfload.read.reader.TensorReader.planned`), so page and request sizes are in
the model.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from otfload.errors import InvalidOptionError
from otfload.gcpause import gc_paused
from otfload.plan.abstract import AbstractLeaf
from otfload.plan.boxes import Box
from otfload.plan.leaf_bytes import held_bytes, leaf_sibling_selection, source_region
from otfload.plan.planner import LeafPlan, LeafSignature, leaf_signature
from otfload.plan.process_bytes import FetchCount
from otfload.read.planned import leaf_planned
from otfload.read.reader import TensorReader

# --- the time model's constants ---------------------------------------------------------------------
# Local files, cold: 64 MiB mapped with MADV_POPULATE_READ in 28-44 ms on this VM's virtio disk
# (~2 GB/s, see ADVISE_CHUNK_BYTES in sources/local.py); a prefetch or preadv call costs ~2 µs.
LOCAL_BANDWIDTH = 2e9
LOCAL_REQUEST_S = 2e-6
# Local files already in the page cache: a builder copies a mapped view at memory speed, per host
# (measured on this 2-core VM at a load average of ~11: column blocks of 384-3,072-byte rows of a warm
# mapped file copied into fresh memory at 0.9-1.9 GB/s).
WARM_BANDWIDTH = 1.5e9
# Remote stores (Hub, GCS): ~1 GB/s per host with 16 requests in flight (docs/benchmarks_remote.md);
# a range request's round trip is 5-50 ms, 16 overlap: ~1.5 ms each.
REMOTE_BANDWIDTH = 1e9
REMOTE_REQUEST_S = 1.5e-3
# Processes of one job share the store (one disk, one bucket's egress, one NFS server): each gets the
# bandwidths above divided by the process count (here 4 processes on one disk; a cluster usually reads
# one shared filesystem or bucket).
SHARED_SOURCE = True
# Device interconnect, bytes/s per process: CPU devices of different processes exchange over Gloo
# on TCP (measured 0.2-1.2 GB/s in total for 4 processes on this 2-core VM: 4-128 MiB all-to-alls);
# accelerators over ICI / NVLink (tens to hundreds of GB/s; 50 GB/s is conservative).
INTERCONNECT_BANDWIDTH = {"cpu": 0.3e9, "gpu": 50e9, "tpu": 50e9}
# One reshard collective: launch and synchronisation (5-13 ms measured here once compiled) ...
RESHARD_FIXED_S = 0.01
# ... and the first of each shape and pair of shardings is compiled (0.3-0.7 s here, shared by
# every leaf of that signature: unscanned layers pay it once). Measured again with 4 processes over
# Gloo on a busier VM: 1.5 s per shape at a load average of ~5, 2-4 s at 9-16 (docs/benchmarks.md,
# "Projection to real clusters"). The loader compiles while the bytes are read (ReshardPrograms), so
# the choice leaves it out; benchmarks/projection.py still adds it to a cluster's reshard time.
RESHARD_COMPILE_S = 0.5
# The bytes bar of a process (issue 34): at most this many times the bytes its devices hold. On a
# cold local disk a leaf whose direct reads fetch more (a column block: most of every page) is read
# as a band; and the time model never picks a band that fetches more than both direct reads and
# this bar (a band over one axis of a small leaf saves requests but reads the leaf whole).
FETCH_TARGET = 1.25
# A process whose local files are at least this fraction resident in its page cache reads them warm:
# the disk then serves at most 10 % of what direct reads fetch (0.4x the ideal for fsdp=8's 4x column
# over-read: within FETCH_TARGET), and a page-cache copy beats a reshard. Below it, the process is cold.
# Not choose_strategy's 98 %: that one decides whether a read-ahead is worth a system call (on this
# shared VM 1-3 % of a file's pages are gone seconds after it was read whole).
WARM_ROUTE_FRACTION = 0.9
# A band must save at least this fraction of the estimated time: the time model's constants are
# estimates, and a reshard that barely saves anything is not worth its memory and synchronisation.
MIN_SAVING = 0.2

POLICIES = ("auto", "always", "never")
# Environment variable holding the default policy of a load (``reshard=None``).
RESHARD_ENV = "OTFLOAD_RESHARD"

# The process of a device (default: its ``process_index``), and the mesh's devices by process.
ProcessOf = Callable[[jax.Device], int]
Groups = Mapping[int, list[jax.Device]]


def resolve_policy(reshard: str | None = None) -> str:
    """The reshard policy of a load: ``reshard`` (its options hold ``$OTFLOAD_RESHARD`` when it was
    not given, :mod:`otfload.options.environment`), else ``"auto"``.

    Raises :class:`~otfload.errors.InvalidOptionError` for a bad value."""
    reshard = "auto" if reshard is None else reshard
    if reshard not in POLICIES:
        raise InvalidOptionError(f"reshard={reshard!r}: expected one of {', '.join(map(repr, POLICIES))}")
    return reshard


@dataclass(frozen=True)
class TimeModel:
    """Seconds per byte and per request of the source, and of the interconnect, for one process
    (the reshard programs are compiled while the bytes are read: no compile term)."""

    source_bandwidth: float
    request_seconds: float
    interconnect_bandwidth: float
    reshard_fixed_seconds: float = RESHARD_FIXED_S

    def fetch_seconds(self, nbytes: int, requests: int) -> float:
        return nbytes / self.source_bandwidth + requests * self.request_seconds

    def reshard_seconds(self, nbytes: int) -> float:
        """Moving ``nbytes`` to one process."""
        return nbytes / self.interconnect_bandwidth + self.reshard_fixed_seconds


def is_local(reader: TensorReader) -> bool:
    """Whether ``reader`` reads local files (fetched in pages, through the page cache)."""
    return reader.maps or reader.pages


def time_model(reader: TensorReader, processes: int, platform: str | None = None, cold: bool = True) -> TimeModel:
    """The model for ``reader``'s source (local files, ``cold`` or warm, or remote) on ``processes``
    processes."""
    local = is_local(reader)
    if local and not cold:  # each host copies from its own page cache
        bandwidth = WARM_BANDWIDTH
    else:
        bandwidth = LOCAL_BANDWIDTH if local else REMOTE_BANDWIDTH
        if SHARED_SOURCE:
            bandwidth /= max(1, processes)
    platform = platform or jax.devices()[0].platform
    return TimeModel(
        source_bandwidth=bandwidth,
        request_seconds=LOCAL_REQUEST_S if local else REMOTE_REQUEST_S,
        interconnect_bandwidth=INTERCONNECT_BANDWIDTH.get(platform, INTERCONNECT_BANDWIDTH["gpu"]),
    )


def plan_mesh(plans: Mapping[str, LeafPlan]) -> Mesh | None:
    """The mesh of a plan's leaves (its first leaf's; None without leaves or a named sharding)."""
    first = next(iter(plans.values()), None)
    return None if first is None else getattr(first.leaf.sharding, "mesh", None)


def process_devices(mesh: Mesh, process_of: ProcessOf | None = None) -> dict[int, list[jax.Device]]:
    """The mesh's devices grouped by process (``process_of(device)``; default its process index)."""
    groups: dict[int, list[jax.Device]] = {}
    for device in mesh.devices.flat:
        groups.setdefault(process_of(device) if process_of else device.process_index, []).append(device)
    return groups


def band_shardings(leaf: AbstractLeaf) -> list[NamedSharding]:
    """Candidate read layouts of ``leaf``: one dimension split over all mesh axes (or over each axis
    alone), every other replicated — each device a contiguous band of that dimension."""
    sharding = leaf.sharding
    if not isinstance(sharding, NamedSharding):
        return []
    mesh = sharding.mesh
    names = tuple(mesh.axis_names)
    options = [names] + [(n,) for n in names if len(names) > 1]
    out = []
    for d, size in enumerate(leaf.shape):
        for axes in options:
            ways = math.prod(mesh.shape[a] for a in axes)
            if ways > 1 and size % ways == 0:
                spec: list[str | tuple[str, ...] | None] = [None] * len(leaf.shape)
                spec[d] = axes if len(axes) > 1 else axes[0]
                out.append(NamedSharding(mesh, PartitionSpec(*spec)))  # type: ignore[no-untyped-call]  # jax: untyped
    return out


@dataclass(frozen=True)
class Choice:
    """How one leaf is read: ``sharding`` (None: directly in its target sharding) and why."""

    sharding: NamedSharding | None
    direct_bytes: int
    band_bytes: int
    seconds_direct: float
    seconds_band: float


class LeafFetches:
    """What ``reader`` fetches for sets of boxes of ``plan``'s leaf (:func:`leaf_planned`), each
    distinct read costed once. :func:`leaf_planned` depends on the boxes only through what the builder
    reads for them — the source region (box, selection, siblings' selection: :func:`source_region`,
    :func:`leaf_sibling_selection`) and the stacked tensors read (those the boxes' stack dims span)
    — so boxes equal in those fetch the same: direct reads and the bands that split the same
    dimension over more axes often ask one process for the same region (fsdp=32 x ep=8: each
    process's column block of a fused expert tensor, whether 8 devices split it by experts or by
    columns)."""

    def __init__(self, plan: LeafPlan, reader: TensorReader):
        self._plan, self._reader = plan, reader
        self._counts: dict[Hashable, FetchCount] = {}

    def __call__(self, boxes: list[Box]) -> FetchCount:
        plan = self._plan
        if not boxes or not plan.sources:
            return leaf_planned(plan, boxes, self._reader)
        n = len(plan.stack_axes)
        union, selection = source_region(plan, boxes)
        stacked = tuple(sorted({box[:n] for box in boxes}))  # they give leaf_reads' tensor indices
        key = (union, selection, leaf_sibling_selection(plan, boxes), stacked)
        count = self._counts.get(key)
        if count is None:
            count = self._counts[key] = leaf_planned(plan, boxes, self._reader)
        return count


def _fetch(
    plan: LeafPlan, sharding: Sharding | None, groups: Groups, fetches: LeafFetches, sample: Iterable[int]
) -> tuple[int, int]:
    """The largest ``(bytes, requests)`` any sampled process fetches for ``plan``'s leaf under ``sharding``."""
    worst = (0, 0)
    for p in sample:
        worst = max(worst, fetches(plan.device_boxes(groups[p], sharding)))
    return worst


def _over_target(plan: LeafPlan, groups: Groups, fetches: LeafFetches, sample: Iterable[int], target: float) -> bool:
    """Whether direct reads make a sampled process fetch more than ``target`` times its ideal bytes."""
    return any(fetches(plan.device_boxes(groups[p]))[0] > target * plan.ideal_bytes(groups[p]) for p in sample)


def choose_leaf(
    plan: LeafPlan, reader: TensorReader, groups: Groups, model: TimeModel, policy: str,
    byte_target: float | None = None,
) -> Choice:
    """Read ``plan``'s leaf directly or as a band: ``"auto"`` takes the band that the time model says
    saves at least MIN_SAVING of the time — or, given ``byte_target`` (a cold local disk), the band
    fetching the fewest bytes when direct reads fetch more than ``byte_target`` times the ideal;
    ``"always"`` the band fetching the fewest bytes (then requests), if that is fewer than direct
    reads fetch."""
    keys = sorted(groups)
    sample = sorted({keys[0], keys[len(keys) // 2], keys[-1]})
    fetches = LeafFetches(plan, reader)
    direct = _fetch(plan, None, groups, fetches, sample)
    t_direct = model.fetch_seconds(*direct)
    best = Choice(None, direct[0], direct[0], t_direct, t_direct)
    if len(groups) < 2 or policy == "never" or not plan.sources or plan.layout is not None:
        return best  # a leaf whose stack dims do not lead is read box by box, into the tree's layout
    moved = max(held_bytes(plan.leaf, groups[p]) for p in sample)  # what a reshard delivers to them at most
    over = byte_target is not None and _over_target(plan, groups, fetches, sample, byte_target)
    by_bytes = policy == "always" or over
    byte_cap = max(direct[0], FETCH_TARGET * max(plan.ideal_bytes(groups[p]) for p in sample))
    bands = [(candidate, _fetch(plan, candidate, groups, fetches, sample)) for candidate in band_shardings(plan.leaf)]
    t_reshard = model.reshard_seconds(moved)
    best = _best_band(bands, direct, t_direct, model, t_reshard, by_bytes, byte_cap)
    if by_bytes and policy == "auto" and best.sharding is None:  # no band fetches fewer bytes: by time
        best = _best_band(bands, direct, t_direct, model, t_reshard, False, byte_cap)
    return best


def _best_band(
    bands: Sequence[tuple[NamedSharding, tuple[int, int]]], direct: tuple[int, int], t_direct: float,
    model: TimeModel, t_reshard: float, by_bytes: bool, byte_cap: float,
) -> Choice:
    """By bytes: the band fetching the fewest bytes, then requests; by time: the least time, below
    MIN_SAVING of the direct read's (bands fetching more than ``byte_cap`` left out); else ``direct``."""
    best = Choice(None, direct[0], direct[0], t_direct, t_direct)
    best_key = (float(direct[0]), float(direct[1])) if by_bytes else (t_direct * (1 - MIN_SAVING), 0.0)
    for candidate, band in bands:
        if not by_bytes and band[0] > byte_cap:
            continue
        t_band = model.fetch_seconds(*band) + t_reshard
        key = (float(band[0]), float(band[1])) if by_bytes else (t_band, 0.0)
        if key < best_key:
            best, best_key = Choice(candidate, direct[0], band[0], t_direct, t_band), key
    return best


def choose_read_shardings(
    plans: Mapping[str, LeafPlan],
    reader: TensorReader,
    policy: str = "auto",
    process_of: ProcessOf | None = None,
    platform: str | None = None,
    cold: bool = True,
) -> dict[str, Choice]:
    """``{leaf path: Choice}`` for the leaves read in another layout than their target's; ``cold``:
    whether local files are read from the disk (agreed by every process, :mod:`otfload.place.agree`;
    default for plans made without a load: cold). A pure function of its arguments."""
    policy = resolve_policy(policy)
    mesh = plan_mesh(plans)
    if policy == "never" or mesh is None:
        return {}
    groups = process_devices(mesh, process_of)
    if len(groups) < 2:
        return {}
    model = time_model(reader, len(groups), platform, cold)
    byte_target = FETCH_TARGET if cold and is_local(reader) else None
    chosen: dict[str, Choice] = {}
    memo: dict[LeafSignature, Choice] = {}
    with gc_paused():  # the boxes, selections and fetch plans costed here are cached or acyclic
        for path, p in plans.items():
            key = leaf_signature(p)
            if key not in memo:  # unscanned layers repeat: each signature is costed once
                memo[key] = choose_leaf(p, reader, groups, model, policy, byte_target)
            if memo[key].sharding is not None:
                chosen[path] = memo[key]
    return chosen


def with_sharding(plan: LeafPlan, sharding: Sharding) -> LeafPlan:
    """``plan`` with its leaf placed in ``sharding`` instead of its target sharding."""
    return dataclasses.replace(plan, leaf=plan.leaf._replace(sharding=sharding))


def cold_processes(resident: Sequence[float | None]) -> list[int]:
    """The processes whose local files are cold: less than WARM_ROUTE_FRACTION resident (or unknown)."""
    return [q for q, r in enumerate(resident) if r is None or r < WARM_ROUTE_FRACTION]


def route(policy: str, local: bool, resident: Sequence[float | None], chosen: Mapping[str, Choice]) -> str:
    """Which route a load took and why, for the report: the policy, the source, the page cache's
    agreed state (``resident``: per process, the fraction of its local files resident) and the rule
    that chose the bands."""
    if len(resident) < 2:
        return "one process: every leaf read in place"
    bands = f"{len(chosen)} leaves read as bands and resharded" if chosen else "every leaf read in place"
    if policy != "auto":
        return f"reshard={policy!r}: {bands}"
    if not local:
        return f"remote source: {bands} (time model: fetch + reshard against direct reads)"
    cold = cold_processes(resident)
    shown = ", ".join("?" if r is None else f"{r:.0%}" for r in resident)
    if cold:
        worst = max((c.direct_bytes / max(1, c.band_bytes) for c in chosen.values()), default=1.0)
        return (f"local files cold on process(es) {cold} (resident: {shown}; warm from "
                f"{WARM_ROUTE_FRACTION:.0%}): {bands} where direct reads would fetch over {FETCH_TARGET}x their "
                f"share (direct up to {worst:.1f}x a band's bytes) or the time model says so")
    return (f"local files warm on every process (resident: {shown}): {bands} (time model: a page-cache copy "
            f"against a reshard)")


def _identity(x: jax.Array) -> jax.Array:
    return x


class ReshardPrograms:
    """The reshard program of each distinct (shape, dtype, band, target) of a load, compiled in one
    background thread from the moment the choices are made — while the builders read — so that a
    compile is neither on the reshards' path nor an input to a choice. A program is XLA's own
    ``jax.device_put`` between two shardings of one device set: an identity ``jit`` with the target
    as its output sharding."""

    def __init__(self, plans: Mapping[str, LeafPlan], bands: Mapping[str, NamedSharding]):
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="otfload-compile")
        self._programs: dict[tuple[Any, ...], Future[Any]] = {}
        for path, band in bands.items():
            leaf = plans[path].leaf
            key = self._key(leaf.shape, leaf.dtype, band, leaf.sharding)
            if key not in self._programs:
                self._programs[key] = self._pool.submit(self._compile, *key)

    @staticmethod
    def _key(shape: Iterable[int], dtype: Any, band: Sharding, target: Sharding) -> tuple[Any, ...]:
        return tuple(shape), np.dtype(dtype), band, target

    @staticmethod
    def _compile(shape: tuple[int, ...], dtype: np.dtype[Any], band: Sharding, target: Sharding) -> Any:
        abstract = jax.ShapeDtypeStruct(shape, dtype, sharding=band)  # type: ignore[no-untyped-call]  # jax: untyped
        return jax.jit(_identity, out_shardings=target).lower(abstract).compile()

    def reshard(self, array: jax.Array, target: Sharding) -> jax.Array:
        """``array`` (read as a band: a :func:`band_shardings` layout) moved to ``target`` over the
        interconnect (a collective: every process calls it), once the collective has completed."""
        key = self._key(array.shape, array.dtype, array.sharding, target)
        program = self._programs[key].result() if key in self._programs else None
        out: jax.Array = program(array) if program is not None else jax.device_put(array, target)
        out.block_until_ready()
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
