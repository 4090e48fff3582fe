"""Hooks run on the device: the raw bytes of each shard go over as stored, the device lays them out.

On an accelerator the host is the slow side: a transposing copy runs at ~1 GB per CPU-second (XLA's
host kernel, docs/benchmarks.md "Transposed loads"), a cast or a scale at memory speed on one core,
while the device does either at hundreds of GB/s. So where a leaf's hooks change the layout or the
values (a transpose, a head split through a transpose, a slice, a scale, a cast to another dtype),
the builder does not apply them on the host. For each device box it reads, as for the host route,
the box of every source tensor the box needs (carried back through the hooks), copies those pieces
— untransposed, in the stored dtype — into one host buffer ``[slices, *source box]`` (the stack of
layers or experts is this copy), sends it to every device holding the box, and one jitted function
per (hooks, box, dtype) — compiled once, cached — applies the hooks to every slice (``vmap``), crops,
and casts there. The result is bitwise the host route's: the hooks are the same code run on
``jax.Array`` s (transposes, reshapes and slices move values; a scale multiplies in the stored dtype
as numpy does; the final cast rounds as numpy's).

Each function is compiled ahead, while the bytes are read: :func:`compile_ahead` lowers and
compiles, in background threads, the function of every (leaf, device box) the plan will lay out — the
shapes are known from the plan alone — so that a builder finds it ready (or waits only for what is
left of its compile) instead of compiling in the load's path (~0.3 s each on CPU devices, more on GPUs).

Used for leaves whose sources are all stored tensors (a quantized or adapted weight is decoded on
the host as before) and whose hooks do something (a leaf stored as it is loaded has nothing to do
on the device). :func:`device_hooks_policy`: ``"auto"`` (accelerators only; default), ``"always"``
(CPU devices too: what the tests compare against the host route), ``"never"``.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import jax
import numpy as np

from otfload.index.derived import is_derived
from otfload.plan.boxes import Box, box_nbytes, box_shape, crop
from otfload.plan.hooks import Hook, chain_apply, chain_needed
from otfload.plan.leaf_bytes import addressable_boxes
from otfload.plan.planner import LeafPlan
from otfload.read.arena import Arena, aligned_empty

# Where hooks run: "auto" (on accelerators), "always", "never".
DEVICE_HOOKS_ENV = "OTFLOAD_DEVICE_HOOKS"
POLICIES = ("auto", "always", "never")
# Threads compiling layout functions ahead: XLA's compiler runs outside the GIL, but the builders
# need the cores too; two keep a few dozen small compiles ahead of the reads.
COMPILE_THREADS = 2
# Jitted layout functions kept: one per distinct (hooks, boxes, dtypes) — a leaf kind of a model on
# one mesh needs a few (one per distinct device box), a whole model a few hundred at most.
TRANSFORM_CACHE_SIZE = 1024


def hooks_on_device(plan: LeafPlan, policy: str = "auto") -> bool:
    """Whether ``plan``'s leaf is laid out on its devices under ``policy`` (one of :data:`POLICIES`,
    the load's ``device_hooks``; see the module docstring)."""
    if policy == "never" or not plan.sources or any(is_derived(info) for info in plan.sources):
        return False
    if plan.layout is not None:  # stack dims placed inside the leaf: the host writes the tree's layout
        return False
    if not plan.hooks and all(info.dtype == plan.leaf.dtype for info in plan.sources):
        return False  # nothing to do: the bytes as stored are the leaf's
    devices: set[jax.Device] = plan.leaf.sharding.device_set
    return policy == "always" or all(d.platform != "cpu" for d in devices)


def raw_need(plan: LeafPlan, box: Box) -> Box:
    """The box of each source tensor that ``box`` of the leaf needs (its stack dims dropped)."""
    return chain_needed(plan.hooks, plan.shapes, box[len(plan.stack_axes) :])


# The builder's stack step: (plan, box, need, union, combos, parts, results) -> None (see builder._build).
Stacker = Callable[
    [LeafPlan, Box, Box, Box, list[tuple[int, ...]], dict[tuple[int, ...], np.ndarray], dict[Box, np.ndarray]], None
]


def raw_stacker(staging: Arena | None) -> Stacker:
    """The stack step of the device route: the pieces of a box present in a chunk's ``parts`` (source
    boxes ``union``), cropped to ``need`` (:func:`raw_need` of the box), copied into their rows of
    ``results[box]`` — ``[slices, *need]`` in the stored dtype, in ``staging`` (else a fresh aligned
    buffer) — with one ``np.stack``, no hook applied."""

    def stack(plan: LeafPlan, box: Box, need: Box, union: Box, combos: list[tuple[int, ...]],
              parts: dict[tuple[int, ...], np.ndarray], results: dict[Box, np.ndarray]) -> None:
        rows = [i for i, c in enumerate(combos) if c in parts]  # consecutive: chunks follow row-major order
        if not rows:
            return
        if box not in results:
            shape, dtype = (len(combos), *box_shape(need)), plan.sources[0].dtype
            if staging is None:
                results[box] = aligned_empty(shape, dtype)
            else:
                results[box] = staging.take(box_nbytes(need, dtype.itemsize) * len(combos)).view(dtype).reshape(shape)
        pieces = [crop(parts[combos[i]], union, need) for i in rows]
        np.stack(pieces, axis=0, out=results[box][rows[0] : rows[-1] + 1])

    return stack


def _layout_of(plan: LeafPlan, box: Box) -> tuple[Callable[[jax.Array], jax.Array], jax.ShapeDtypeStruct]:
    """The jitted layout function of ``box`` of ``plan``'s leaf, and its input's shape and dtype."""
    n_stack, need = len(plan.stack_axes), raw_need(plan, box)
    lead_shape, dtype = box_shape(box[:n_stack]), np.dtype(plan.leaf.dtype)
    layout = transform(plan.hooks, plan.shapes, need, box[n_stack:], lead_shape, dtype)
    lead = int(np.prod(lead_shape, dtype=np.int64))
    return layout, jax.ShapeDtypeStruct((lead, *box_shape(need)), plan.sources[0].dtype)  # type: ignore[no-untyped-call]


def place_on_devices(plan: LeafPlan, box_of: dict[jax.Device, Box], raw: dict[Box, np.ndarray]) -> jax.Array:
    """The leaf, sharded as planned, from each box's raw host buffer: sent to every device holding
    the box, laid out there by the cached jitted function of :func:`transform`."""
    shards = []
    for device, box in box_of.items():
        layout, spec = _layout_of(plan, box)
        _wait_compiled(layout, spec, device)
        shards.append(layout(jax.device_put(raw[box], device)))
    return jax.make_array_from_single_device_arrays(plan.leaf.shape, plan.leaf.sharding, shards)


# Compiles started by compile_ahead and not yet waited for: (function, input, device) -> its future.
_compiling: dict[tuple[object, ...], Future[object]] = {}
_compiling_lock = threading.Lock()


def _wait_compiled(layout: Callable[[jax.Array], jax.Array], spec: jax.ShapeDtypeStruct, device: jax.Device) -> None:
    with _compiling_lock:
        future = _compiling.pop((layout, spec.shape, spec.dtype, device), None)
    if future is not None:
        future.result()  # a compile error is raised here, in the leaf's own build


def compile_ahead(
    plans: Iterable[LeafPlan], policy: str = "auto", workers: int = COMPILE_THREADS
) -> ThreadPoolExecutor | None:
    """Start compiling the layout function of every device box of every leaf in ``plans`` that is
    laid out on its devices under ``policy`` (:func:`hooks_on_device`); returns the pool (shut it down after the
    load) or None when there is nothing to compile."""
    jobs: dict[tuple[object, ...], Callable[[], object]] = {}
    for plan in plans:
        if not hooks_on_device(plan, policy):
            continue
        for device, box in addressable_boxes(plan.leaf.shape, plan.leaf.sharding):
            layout, spec = _layout_of(plan, box)
            key: tuple[object, ...] = (layout, spec.shape, spec.dtype, device)
            on_device = jax.sharding.SingleDeviceSharding(device)
            placed = jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=on_device)  # type: ignore[no-untyped-call]
            jobs.setdefault(key, functools.partial(_compile, layout, placed))
    if not jobs:
        return None
    pool = ThreadPoolExecutor(workers, thread_name_prefix="otfload-compile")
    with _compiling_lock:
        for key, job in jobs.items():
            _compiling.setdefault(key, pool.submit(job))
    return pool


def _compile(layout: Callable[[jax.Array], jax.Array], spec: jax.ShapeDtypeStruct) -> object:
    return layout.lower(spec).compile()  # type: ignore[attr-defined]  # a jitted function


@functools.lru_cache(maxsize=TRANSFORM_CACHE_SIZE)
def transform(
    hooks: Sequence[Hook], shapes: Sequence[tuple[int, ...]], need: Box, inner: Box, lead: tuple[int, ...],
    dtype: np.dtype,
) -> Callable[[jax.Array], jax.Array]:
    """A jitted function from ``[slices, *need]`` raw source boxes to the leaf's box ``[*lead, *inner]``:
    the hooks applied to each slice, cropped to ``inner``, cast to ``dtype``."""

    def one(x: jax.Array) -> jax.Array:
        out, have = chain_apply(hooks, shapes, x, need)  # type: ignore[arg-type]  # the hooks take any array
        return crop(out, have, inner)  # type: ignore[return-value]  # a jax.Array in, a jax.Array out

    def layout(raw: jax.Array) -> jax.Array:
        return jax.vmap(one)(raw).reshape((*lead, *box_shape(inner))).astype(dtype)

    jitted: Callable[[jax.Array], jax.Array] = jax.jit(layout)
    return jitted
