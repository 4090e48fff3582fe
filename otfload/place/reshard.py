"""Read in the storage's own layout, reshard on the devices.

A leaf whose target sharding splits its HF tensors' contiguous (column) axis across processes makes
each process read a column block: thousands of short runs, and — since the kernel and remote stores
fetch pages and ranges, not columns — most of every row (a 4 KiB page of a 4 KiB row holds every
process's columns). Instead such a leaf can be read as a *band*: the leaf sharded on one dimension
over all mesh axes, so that each process reads contiguous source rows (its 1/P share of the bytes,
as many as the ideal), then moved to its target ``NamedSharding`` with one collective
(``jax.device_put``) over the devices' interconnect.

The choice is made per leaf by :func:`choose_read_shardings` with a small cost model
(:class:`CostModel`): the time to fetch what each layout fetches (bytes over the source's bandwidth,
plus a latency per request) against the band's fetch time plus the reshard (bytes moved over the
interconnect, plus a fixed cost per collective and a compile per new shape). Direct reads are kept
where they win: one process (every device's box is local, the bounding box is the tensor), rows
already split, replicated leaves.

Every process must make the same choices and run the reshards in the same order (they are
collectives): choices depend only on the plan, the mesh and the source kind, and
:func:`~otfload.place.loader.execute_plan` runs them in plan order once every leaf is built. The
bytes each layout fetches come from the reader's own plan (pages of local files, merged remote
ranges: :meth:`~otfload.read.reader.TensorReader.planned`), so page and request sizes are in the model.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from otfload.errors import InvalidOptionError
from otfload.place.report import leaf_planned
from otfload.plan.abstract import AbstractLeaf
from otfload.plan.hooks import Hook, Shape
from otfload.plan.planner import LeafPlan
from otfload.read.reader import TensorReader

# --- the cost model's constants ---------------------------------------------------------------------
# Local files, cold: 64 MiB mapped with MADV_POPULATE_READ in 28-44 ms on this VM's virtio disk
# (~2 GB/s, see ADVISE_CHUNK_BYTES in sources/local.py); a prefetch or preadv call costs ~2 µs.
LOCAL_BANDWIDTH = 2e9
LOCAL_REQUEST_S = 2e-6
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
# "Projection to real clusters"); a compile is CPU-bound, so it is the term a loaded host inflates.
RESHARD_COMPILE_S = 0.5
# A band must save at least this fraction of the estimated time: the cost model's constants are
# estimates, and a reshard that barely saves anything is not worth its memory and synchronisation.
MIN_SAVING = 0.2

POLICIES = ("auto", "always", "never")
# Environment variable holding the default policy of a load (``reshard=None``).
RESHARD_ENV = "OTFLOAD_RESHARD"

# The process of a device (default: its ``process_index``), and the mesh's devices by process.
ProcessOf = Callable[[jax.Device], int]
Groups = Mapping[int, list[jax.Device]]


def resolve_policy(reshard: str | None = None) -> str:
    """The reshard policy of a load: ``reshard``, else ``$OTFLOAD_RESHARD``, else ``"auto"``.

    Raises :class:`~otfload.errors.InvalidOptionError` naming where a bad value came from."""
    origin = "reshard"
    if reshard is None:
        reshard, origin = os.environ.get(RESHARD_ENV) or "auto", RESHARD_ENV
    if reshard not in POLICIES:
        raise InvalidOptionError(f"{origin}={reshard!r}: expected one of {', '.join(map(repr, POLICIES))}")
    return reshard


@dataclass(frozen=True)
class CostModel:
    """Seconds per byte and per request of the source, and of the interconnect, for one process."""

    source_bandwidth: float
    request_seconds: float
    interconnect_bandwidth: float
    reshard_fixed_seconds: float = RESHARD_FIXED_S
    compile_seconds: float = RESHARD_COMPILE_S

    def fetch_seconds(self, nbytes: int, requests: int) -> float:
        return nbytes / self.source_bandwidth + requests * self.request_seconds

    def reshard_seconds(self, nbytes: int, same_signature: int) -> float:
        """Moving ``nbytes`` to one process; ``same_signature`` leaves share the compile (0: compiled)."""
        compile_share = self.compile_seconds / same_signature if same_signature else 0.0
        return nbytes / self.interconnect_bandwidth + self.reshard_fixed_seconds + compile_share


def cost_model(reader: TensorReader, processes: int, platform: str | None = None) -> CostModel:
    """The model for ``reader``'s source (local files or remote) on ``processes`` processes."""
    local = reader.maps or reader.pages
    bandwidth = LOCAL_BANDWIDTH if local else REMOTE_BANDWIDTH
    if SHARED_SOURCE:
        bandwidth /= max(1, processes)
    platform = platform or jax.devices()[0].platform
    return CostModel(
        source_bandwidth=bandwidth,
        request_seconds=LOCAL_REQUEST_S if local else REMOTE_REQUEST_S,
        interconnect_bandwidth=INTERCONNECT_BANDWIDTH.get(platform, INTERCONNECT_BANDWIDTH["gpu"]),
    )


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


def _fetch(
    plan: LeafPlan, sharding: Sharding | None, groups: Groups, reader: TensorReader, sample: Iterable[int]
) -> tuple[int, int]:
    """The largest ``(bytes, requests)`` any sampled process fetches for ``plan``'s leaf under ``sharding``."""
    worst = (0, 0)
    for p in sample:
        got = leaf_planned(plan, plan.device_boxes(groups[p], sharding), reader)
        worst = max(worst, got)
    return worst


def choose_leaf(
    plan: LeafPlan, reader: TensorReader, groups: Groups, model: CostModel, policy: str, same: int
) -> Choice:
    """Read ``plan``'s leaf directly or as a band: ``"auto"`` takes the band that the cost model says
    saves at least MIN_SAVING of the time, ``"always"`` the band fetching the fewest bytes (then
    requests), if that is fewer than direct reads fetch."""
    keys = sorted(groups)
    sample = sorted({keys[0], keys[len(keys) // 2], keys[-1]})
    direct = _fetch(plan, None, groups, reader, sample)
    t_direct = model.fetch_seconds(*direct)
    best = Choice(None, direct[0], direct[0], t_direct, t_direct)
    if len(groups) < 2 or policy == "never" or not plan.sources:
        return best
    moved = max(leaf_moved_bytes(plan, groups[p]) for p in sample)
    # "always": fewest bytes, then requests; "auto": least time, below MIN_SAVING of the direct read's
    best_key = (float(direct[0]), float(direct[1])) if policy == "always" else (t_direct * (1 - MIN_SAVING), 0.0)
    target = cast(NamedSharding, plan.leaf.sharding)  # band_shardings gives candidates for named shardings only
    for candidate in band_shardings(plan.leaf):
        band = _fetch(plan, candidate, groups, reader, sample)
        compiled = _signature(plan.leaf.shape, plan.leaf.dtype, candidate, target) in _compiled
        t_band = model.fetch_seconds(*band) + model.reshard_seconds(moved, 0 if compiled else same)
        key = (float(band[0]), float(band[1])) if policy == "always" else (t_band, 0.0)
        if key < best_key:
            best, best_key = Choice(candidate, direct[0], band[0], t_direct, t_band), key
    return best


def leaf_moved_bytes(plan: LeafPlan, devices: Iterable[jax.Device]) -> int:
    """Target-dtype bytes of the shards ``devices`` hold: what a reshard delivers to them at most."""
    from otfload.plan.boxes import box_size

    itemsize = plan.leaf.dtype.itemsize
    return sum(box_size(b) for b in plan.device_boxes(devices)) * itemsize


# A reshard's program: shape, dtype, band spec, target spec and the target mesh's identity.
Signature = tuple[tuple[int, ...], str, str, str, int]
_compiled: set[Signature] = set()  # reshard signatures this process has run: their programs are compiled


def _signature(
    shape: Sequence[int], dtype: np.dtype[Any], band: NamedSharding, target: NamedSharding
) -> Signature:
    return tuple(shape), str(dtype), str(band.spec), str(target.spec), id(target.mesh)


def choose_read_shardings(
    plans: Mapping[str, LeafPlan],
    reader: TensorReader,
    policy: str = "auto",
    process_of: ProcessOf | None = None,
    platform: str | None = None,
) -> dict[str, Choice]:
    """``{leaf path: Choice}`` for the leaves read in another layout than their target's."""
    policy = resolve_policy(policy)
    if policy == "never" or not plans:
        return {}
    first = next(iter(plans.values())).leaf.sharding
    mesh = getattr(first, "mesh", None)
    if mesh is None:
        return {}
    groups = process_devices(mesh, process_of)
    if len(groups) < 2:
        return {}
    model = cost_model(reader, len(groups), platform)
    signatures: dict[LeafSignature, list[LeafPlan]] = {}
    for p in plans.values():
        signatures.setdefault(leaf_signature(p), []).append(p)
    chosen: dict[str, Choice] = {}
    memo: dict[LeafSignature, Choice] = {}
    for path, p in plans.items():
        key = leaf_signature(p)
        if key not in memo:  # unscanned layers repeat: each signature is costed once
            memo[key] = choose_leaf(p, reader, groups, model, policy, len(signatures[key]))
        if memo[key].sharding is not None:
            chosen[path] = memo[key]
    return chosen


# What a leaf's reads depend on (see leaf_signature): shape, dtype, spec, hooks, shapes, sources'
# count, storage and the first source's shape.
LeafSignature = tuple[
    tuple[int, ...], str, str, tuple[Hook, ...], tuple[Shape, ...], int, str, tuple[int, ...] | None
]


def leaf_signature(plan: LeafPlan) -> LeafSignature:
    """What a leaf's reads depend on but the tensors' names and offsets: leaves with equal
    signatures (the layers of an unscanned model) read alike."""
    leaf = plan.leaf
    first = plan.sources[0] if plan.sources else None
    return (leaf.shape, str(leaf.dtype), str(getattr(leaf.sharding, "spec", leaf.sharding)), plan.hooks,
            plan.shapes, len(plan.sources), plan.storage, getattr(first, "shape", None))


def with_sharding(plan: LeafPlan, sharding: Sharding) -> LeafPlan:
    """``plan`` with its leaf placed in ``sharding`` instead of its target sharding."""
    return dataclasses.replace(plan, leaf=plan.leaf._replace(sharding=sharding))


def reshard(array: jax.Array, target: Sharding) -> jax.Array:
    """``array`` (read as a band: a :func:`band_shardings` layout) moved to ``target`` over the
    interconnect (a collective: every process calls it). Only leaves with a ``NamedSharding`` get
    bands, so both are named shardings."""
    out: jax.Array = jax.device_put(array, target)
    _compiled.add(_signature(array.shape, array.dtype, cast(NamedSharding, array.sharding),
                             cast(NamedSharding, target)))
    return out
