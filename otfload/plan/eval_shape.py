"""An abstract model from its constructor, without JAX's quadratic tracing cost.

``nnx.eval_shape(lambda: Model(...))`` traces the model's initialisation into one jaxpr. In JAX up
to 0.10 (fixed upstream by jax-ml/jax#40041) asking a tracer for ``.sharding`` raises an
``AttributeError`` whose message is built eagerly, and part of that message (the tracer's "origin")
walks every equation traced so far. Flax NNX asks on every value it assigns to a ``Variable``
(``Variable.set_value`` compares shardings), and an ``nnx.Rngs`` stream assigns its counter on every
draw, so each parameter's initialiser walks the whole trace before it: quadratic in the number of
parameters. Measured on tunix's Qwen3 (157 parameters, 1 GB, docs/benchmarks.md "tunix itself"):
``nnx.eval_shape`` 1.07-1.38 s, the same trace without the origin walk 0.21-0.46 s (GC-dependent).

:func:`abstract_module` runs ``nnx.eval_shape`` with the tracer origin left out of error messages
while it runs — the one thing that changes is that an error raised by tracing the constructor lacks
the "this value became a tracer due to ..." paragraph. Where JAX has no such method (a version that
changed it) the plain ``nnx.eval_shape`` runs. The patch is process-wide — JAX code other threads
trace meanwhile loses the same paragraph from its errors, nothing else — and concurrent and nested
calls share it, restored when the last ends. Python's cyclic collector is paused meanwhile
(``otfload.gcpause``): the trace's objects all live until it ends, and collections cost 10-50 % more
time here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from flax import nnx

from otfload.gcpause import gc_paused
from otfload.held import HeldSetting

T = TypeVar("T")
# The method of JAX's jaxpr tracer that builds the origin part of its error messages.
_ORIGIN_METHOD = "_origin_msg"


def _tracer_class() -> type | None:
    """JAX's jaxpr-tracing tracer if it builds origin messages the way described above, else None."""
    try:
        from jax._src.interpreters import partial_eval
    except ImportError:  # pragma: no cover - a JAX that moved its internals
        return None
    tracer = getattr(partial_eval, "DynamicJaxprTracer", None)
    return tracer if tracer is not None and callable(vars(tracer).get(_ORIGIN_METHOD)) else None


def _no_origin(_tracer: object) -> str:
    return ""


def _leave_out_origin() -> tuple[type, Any] | None:
    tracer = _tracer_class()
    if tracer is None:
        return None
    saved = vars(tracer)[_ORIGIN_METHOD]
    setattr(tracer, _ORIGIN_METHOD, _no_origin)
    return tracer, saved


def _put_back_origin(saved: tuple[type, Any] | None) -> None:
    if saved is not None:
        setattr(saved[0], _ORIGIN_METHOD, saved[1])


_ORIGIN_LEFT_OUT = HeldSetting(_leave_out_origin, _put_back_origin)


def abstract_module(factory: Callable[[], T]) -> T:
    """``nnx.eval_shape(factory)`` — the abstract model (shapes, dtypes, sharding metadata, nothing
    allocated) — in time linear in its parameters (see :mod:`otfload.plan.eval_shape`).

    ``factory`` takes no argument and builds the model (``lambda: Model(config, rngs=nnx.Rngs(0))``);
    a pytree of arrays works too (its leaves come back as ``jax.ShapeDtypeStruct``).
    """
    with _ORIGIN_LEFT_OUT.held(), gc_paused():  # what the trace builds lives on: no garbage to collect
        return nnx.eval_shape(factory)
