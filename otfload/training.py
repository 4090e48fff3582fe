"""Training start-up: the train step compiles while the weights load.

A compiled train step depends only on the shapes, dtypes and shardings of what it takes (the
model's parameters, the optimizer's state and the batch), and :func:`otfload.plan_model` knows the
parameters' from ``config.json`` and the safetensors headers before a byte of weight is read. So the
step can be lowered and compiled against the abstract model while :func:`otfload.from_pretrained`
reads the weights, and the first step starts when the later of the two is done instead of after
both:

* :func:`abstract_model`: the model ``from_pretrained`` returns, each ``nnx.Param`` a
  ``jax.ShapeDtypeStruct`` that carries the ``NamedSharding`` the load will give it.
* :func:`abstract_optimizer`: the ``nnx.Optimizer`` of such a model. Its leaves that mirror a
  parameter (Adam's moments: the same path below the optimizer state's own keys, the same shape)
  are sharded like the parameter; the rest (step counts) are replicated on the mesh.
  :func:`place_like` puts a real optimizer's state on those shardings (optax makes its counts
  on one device), so the compiled step takes it as it is.
* :func:`shardings_of`: an abstract module's shardings as ``nnx.jit(..., in_shardings=...)`` takes
  them, which pins the step's outputs to its inputs' shardings (every step runs one program).
* :func:`load_while_compiling`: ``compile(abstract model)`` on a thread while ``from_pretrained``
  loads on the caller's, both from one plan (:func:`otfload.api.plan_load`); the model, what
  ``compile`` returned and the :class:`StartupTimes`.

Where the time goes (the 160 M-parameter preset of ``benchmarks/bench_train_startup.py`` on 2 CPU
cores): the trace and lowering are Python on one core, holding the GIL throughout; XLA's compile
releases the GIL and keeps both cores busy for ~90 % of its time (one thread at its start and end);
the load is ~0.6 CPU-seconds and its transfers are not slowed by a compile running beside them. The
load cannot use the core the lowering leaves idle: at Python's 5 ms switch interval its threads get
almost no GIL turns while the step lowers, and a shorter interval lets them in only by slowing the
lowering about as much as it saves later. So the load runs mostly beside XLA's compiler threads,
and takes :data:`BUILDERS_LEFT_TO_THE_COMPILE` builder thread fewer than alone (unless ``workers``
is given). docs/benchmarks.md ("Training start-up") has the measurements.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, Unpack

import jax
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from otfload.api import plan_load, plan_model
from otfload.opening import default_workers
from otfload.options import LoadKeywords, LoadOptions, resolve_options
from otfload.plan.abstract import dotted
from otfload.plan.planner import LoadPlan
from otfload.plan.sharding import make_mesh
from otfload.sources import Source
from otfload.sources.owned import owned

T = TypeVar("T")

# Builder threads the load gives up beside the compile (unless ``workers`` is given): the trace and
# lowering run on one core. Measured on 2 cores (small preset, quiet, docs/benchmarks.md): ready in
# 3.01-3.05 s with one builder against 3.07-3.27 s with the load's default two.
BUILDERS_LEFT_TO_THE_COMPILE = 1


@dataclass(frozen=True)
class StartupTimes:
    """Seconds from the call: ``planned`` (abstract model ready), ``loaded`` (weights placed),
    ``compiled`` (the compile callback returned); ``ready`` is the later of the last two."""

    planned: float
    loaded: float
    compiled: float

    @property
    def ready(self) -> float:
        return max(self.loaded, self.compiled)


@dataclass(frozen=True)
class Startup(Generic[T]):
    """What :func:`load_while_compiling` returns: the loaded model, the compile callback's result
    and the times."""

    model: nnx.Module
    compiled: T
    times: StartupTimes


def abstract_model(
    source: str | os.PathLike[str] | Source, *, options: LoadOptions | None = None, **keywords: Unpack[LoadKeywords]
) -> nnx.Module:
    """The model ``from_pretrained(source, options=options, **keywords)`` returns (``mesh=``, ``dtype=``,
    ``scan_layers=``, ...), with a ``jax.ShapeDtypeStruct`` (shape, dtype and ``NamedSharding``) for
    each ``nnx.Param``: what ``nnx.jit(step).lower(...)`` needs. Reads headers and ``config.json`` only."""
    model, plan, src = plan_model(source, options=resolve_options(options, keywords))
    with owned(src, source):  # closed here unless the caller passed it in
        return _placed(model, plan)


def _placed(model: nnx.Module, plan: LoadPlan) -> nnx.Module:
    """``model`` (planned, abstract) with each ``nnx.Param`` the shape, dtype and sharding ``plan``
    gives its leaf."""
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        leaf = plan.leaves[dotted(path)].leaf
        # jax's ShapeDtypeStruct and PartitionSpec constructors are unannotated.
        var.set_value(jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding))  # type: ignore[no-untyped-call]
    return model


def abstract_optimizer(
    model: nnx.Module, tx: optax.GradientTransformation, mesh: Mesh, wrt: Any = nnx.Param
) -> nnx.Optimizer[Any]:
    """``nnx.Optimizer(model, tx, wrt=wrt)`` for an :func:`abstract_model`, without allocating: each
    leaf a ``jax.ShapeDtypeStruct`` sharded as the module docstring says."""
    optimizer = nnx.eval_shape(lambda m: nnx.Optimizer(m, tx, wrt=wrt), model)
    params = {path: var.get_value() for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
    replicated = NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]

    def sharded(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        # the parameter whose path ends this leaf's path (Adam's mu/nu mirror the parameter tree)
        mirrored = next((params[path[i:]] for i in range(len(path)) if path[i:] in params), None)
        sharding = mirrored.sharding if mirrored is not None and mirrored.shape == leaf.shape else replicated
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)  # type: ignore[no-untyped-call]

    leaves = nnx.to_flat_state(nnx.state(optimizer))
    placed = [(path, var.replace(sharded(path, var.get_value()))) for path, var in leaves]
    nnx.update(optimizer, nnx.from_flat_state(placed))
    return optimizer


def shardings_of(abstract: nnx.Module) -> nnx.StateSharding:
    """Each leaf's sharding in an abstract module (:func:`abstract_model`, :func:`abstract_optimizer`)
    as an ``nnx.jit`` ``in_shardings`` entry. ``nnx.jit`` gives an argument's in-place updates the
    argument's shardings, so a step's updated parameters and optimizer state come out as they went
    in: left to the compiler, some come out otherwise (a replicated norm scale split on ``fsdp``) and
    the second step compiles a second program (or a step compiled ahead of time refuses them)."""
    flat = [(path, var.get_value().sharding) for path, var in nnx.to_flat_state(nnx.state(abstract))]
    return nnx.StateSharding(nnx.from_flat_state(flat))


def place_like(target: nnx.Module, abstract: nnx.Module) -> None:
    """Move every array of ``target`` onto the sharding of the same leaf of ``abstract`` (an
    :func:`abstract_optimizer`, say): what a step compiled against ``abstract`` requires."""
    shardings = {path: var.get_value().sharding for path, var in nnx.to_flat_state(nnx.state(abstract))}
    flat = [(path, var.replace(jax.device_put(var.get_value(), shardings[path])))
            for path, var in nnx.to_flat_state(nnx.state(target))]
    nnx.update(target, nnx.from_flat_state(flat))


def load_while_compiling(
    source: str | os.PathLike[str] | Source,
    compile: Callable[[nnx.Module], T],
    *,
    options: LoadOptions | None = None,
    **keywords: Unpack[LoadKeywords],
) -> Startup[T]:
    """Load ``source`` with ``from_pretrained(source, options=options, **keywords)`` while
    ``compile(abstract model)`` (see :func:`abstract_model`) runs on a thread under
    ``jax.set_mesh(mesh)`` (the options' mesh; default: every device on ``fsdp``); ``compile``
    typically returns ``nnx.jit(step).lower(abstract, abstract_optimizer(...), batch).compile()``. An
    error of either is raised here (the load's first) once both are done. Both come from one plan;
    unless ``workers`` is given the load takes one builder thread fewer than alone (see the module
    docstring)."""
    start = time.perf_counter()
    load_options = resolve_options(options, keywords)
    mesh = make_mesh() if load_options.mesh is None else load_options.mesh
    load_options = dataclasses.replace(load_options, mesh=mesh)  # one mesh for the compile and the load
    planned = plan_load(source, load_options)  # planned once: the compile's shapes, then the load's reads
    with ExitStack() as on_error:
        on_error.enter_context(owned(planned.opened.source, source))
        if load_options.workers is None:  # the lowering takes a core: one builder fewer than the load alone
            builders = max(1, default_workers(planned.opened.base) - BUILDERS_LEFT_TO_THE_COMPILE)
            planned = dataclasses.replace(planned, options=dataclasses.replace(load_options, workers=builders))
        abstract = _placed(nnx.clone(planned.model), planned.plan)  # its own variables: the load fills the model's
        on_error.pop_all()  # the load closes the checkpoint
    planned_seconds = time.perf_counter() - start
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            with jax.set_mesh(mesh):  # the mesh is per thread; MoE layers read it (expert parallelism)
                result["compiled"] = compile(abstract)
        except BaseException as err:  # re-raised on the caller's thread below
            result["error"] = err
        result["seconds"] = time.perf_counter() - start

    thread = threading.Thread(target=run, name="otfload-compile", daemon=True)
    thread.start()
    try:
        model, _ = planned.load()
        loaded = time.perf_counter() - start
    finally:
        thread.join()
    if "error" in result:
        raise result["error"]
    return Startup(model, result["compiled"], StartupTimes(planned_seconds, loaded, result["seconds"]))
