"""Loglikelihood of continuations, batched: what lm_eval's ``loglikelihood`` requests reduce to.

A request is a context and a continuation, both token ids. As in lm_eval's HF backend, the model
reads ``(context + continuation)[-(max_length + 1):][:-1]`` (cut on the left to the context
window) and the continuation's ids are scored by the logits of the positions that predict them:
the sum of their log-softmax values, and whether each is the argmax (``is_greedy``). Only those
positions' hidden states go through the output projection and the softmax (gathered after the
final norm): a multiple-choice continuation is a few tokens of a long prompt, and the
``[batch, width, vocab]`` logits of every position would cost most of the memory and, for large
vocabularies, much of the time. The scored width is one per job: the longest continuation,
rounded up to a multiple of 16 (at most the batch's width).

Rows are sorted longest first (lm_eval's order) and cut into batches of ``batch_size``; each batch
is padded on the right to one of a few widths chosen from the batches' lengths
(:mod:`otfload.lm_eval.buckets`) and its missing rows are filled with one masked-in token. The
device computes per row only the two numbers lm_eval keeps (log-softmax in float32 whatever the
parameter dtype), so no ``[batch, width, vocab]`` array comes back to the host; they come back
replicated, so that on a mesh spanning several processes (each driving the same batches) every
process reads all of them, and each process places only its own devices' part of a batch.

Each ``[batch, width]`` shape is compiled ahead of running it, against an abstract model (leaves
as ``jax.ShapeDtypeStruct`` with their shardings) when one is given: the shapes are known from the
requests before the weights are, so compilation overlaps the load. Compile and scoring seconds are
counted apart in :class:`Timings`.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from otfload.errors import EvalRequestError
from otfload.lm_eval.buckets import ALIGN, choose_widths, width_for
from otfload.models.attention import make_context
from otfload.models.base import CausalLM
from otfload.plan.sharding import logical_to_sharding
from otfload.programs import CachedJit

# A token-level request as lm_eval's TemplateLM hands it over: ((context, continuation) strings or
# None for rolling windows, context ids, continuation ids).
TokenRequest = tuple[Any, Sequence[int], Sequence[int]]


@dataclass
class Timings:
    """Seconds spent, summed over the job: loading (tokenizer, plan, weights: the wall time of the
    load, which overlaps compilation), compiling (tracing and lowering included), scoring and
    generating."""

    load_seconds: float = 0.0
    compile_seconds: float = 0.0
    lower_seconds: float = 0.0  # of compile_seconds, tracing and lowering (0 for programs an earlier job kept)
    score_seconds: float = 0.0
    generate_seconds: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"load_seconds": self.load_seconds, "compile_seconds": self.compile_seconds,
                "lower_seconds": self.lower_seconds, "score_seconds": self.score_seconds,
                "generate_seconds": self.generate_seconds}


class Shape(NamedTuple):
    """A batch's padded width and its scored width (positions that go through the output projection)."""

    width: int
    scored: int


@dataclass(frozen=True)
class Row:
    """One request as the model reads it: ``ids`` (the input), ``targets`` (each position's next
    id) and ``scored`` (how many trailing positions predict the continuation)."""

    ids: np.ndarray
    targets: np.ndarray
    scored: int


def make_row(context: Sequence[int], continuation: Sequence[int], max_length: int) -> Row:
    """The model input of one request, cut on the left to ``max_length`` ids (lm_eval's rule)."""
    if not continuation:
        raise EvalRequestError("a loglikelihood request has an empty continuation: nothing to score")
    if not context:
        raise EvalRequestError("a loglikelihood request has no context token (lm_eval puts the prefix token there)")
    if len(continuation) > max_length:
        raise EvalRequestError(f"a continuation of {len(continuation)} tokens does not fit the context window of "
                               f"{max_length} (max_length)")
    seq = np.asarray([*context, *continuation], np.int32)[-(max_length + 1):]
    return Row(seq[:-1], seq[1:], len(continuation))


def _loglik_of_batch(model: CausalLM, ids: jax.Array, mask: jax.Array, at: jax.Array, targets: jax.Array,
                     scored: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row: the summed log-probability of the scored targets, and whether each is the argmax.

    ``at [b, c]`` are the positions whose next id is scored (``targets [b, c]``; ``scored`` marks
    the real ones): only their hidden states go through the output projection and the softmax."""
    ctx = make_context(ids, mask, None, None, model.attention_impl, model.moe_impl)
    hidden, _ = model.forward(ids, ctx, None)
    picked_hidden = jnp.take_along_axis(hidden, at[..., None], axis=1)
    logits = model.head(picked_hidden).astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == targets
    return jnp.where(scored, picked, 0.0).sum(-1), (greedy | ~scored).all(-1)


def spans_processes(mesh: Mesh | None) -> bool:
    """Whether ``mesh`` holds devices of other processes (a replica several processes drive)."""
    return mesh is not None and any(d.process_index != jax.process_index() for d in mesh.devices.flat)


class Scorer:
    """Scores :class:`Row` s in batches of ``batch_size``, compiling each shape once.

    ``abstract`` is the model with ``jax.ShapeDtypeStruct`` leaves (shardings included) to compile
    against before the weights are loaded; ``None`` compiles against the real model when it is
    given. ``mesh`` is the model's mesh (rows go on its batch axes), None for single-device arrays.
    """

    def __init__(self, batch_size: int, max_length: int, mesh: Mesh | None, abstract: CausalLM | None,
                 timings: Timings) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}")
        self.batch_size, self.max_length, self.mesh, self.abstract = batch_size, max_length, mesh, abstract
        self.timings = timings
        self._compiled: dict[Shape, Any] = {}
        # The two numbers per row come back replicated: every process reads all of them (and on a
        # mesh spanning processes, a row-sharded result could not be read here).
        replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]
        self._step = CachedJit(_loglik_of_batch, out_shardings=replicated)

    def plan(self, rows: Sequence[Row]) -> list[tuple[list[int], Shape]]:
        """``[(row indices, shape)]``: the batches, longest rows first, and each one's padded width
        and scored width (one for the job: the longest continuation, rounded up to ``ALIGN``)."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].ids))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        widths = choose_widths([len(rows[b[0]].ids) for b in batches], self.max_length)
        longest_scored = -(-max((r.scored for r in rows), default=1) // ALIGN) * ALIGN
        out = []
        for batch in batches:
            width = width_for(len(rows[batch[0]].ids), widths)
            out.append((batch, Shape(width, min(longest_scored, width))))
        return out

    def compile(self, shapes: Sequence[Shape], model: CausalLM | None = None) -> None:
        """Compile the scoring step for each shape not compiled yet (against the abstract model,
        else ``model``)."""
        target = self.abstract if self.abstract is not None else model
        if target is None:
            raise ValueError("nothing to compile against: no abstract model and no model given")
        for shape in shapes:
            if shape in self._compiled:
                continue
            start = time.perf_counter()
            ids, mask = (self._struct(shape.width, dtype) for dtype in (jnp.int32, jnp.bool_))
            at, scored = (self._struct(shape.scored, dtype) for dtype in (jnp.int32, jnp.bool_))
            program = self._step.compile(target, ids, mask, at, at, scored)  # from the kept programs if there
            self.timings.lower_seconds += program.lower_seconds
            self._compiled[shape] = program.compiled
            self.timings.compile_seconds += time.perf_counter() - start

    def _struct(self, width: int, dtype: Any) -> jax.ShapeDtypeStruct:
        shape = (self.batch_size, width)
        return jax.ShapeDtypeStruct(shape, dtype, sharding=self._sharding(width))  # type: ignore[no-untyped-call]

    def score(self, rows: Sequence[Row], model: Callable[[], CausalLM],
              progress: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
        """``(log-probability, is_greedy)`` of each row, in the order given. ``model`` is called
        once the shapes are compiled (it may wait for the weights); ``progress(n)`` after each batch."""
        batches = self.plan(rows)
        shapes = sorted({shape for _, shape in batches})
        if self.abstract is not None:
            self.compile(shapes)
        loaded = model()
        self.compile(shapes, loaded)
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        start = time.perf_counter()
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            pending = [(b, self._run(loaded, [rows[i] for i in b], shape)) for b, shape in batches]  # all dispatched
            for batch, (logp, greedy) in pending:
                logp_host, greedy_host = np.asarray(logp), np.asarray(greedy)
                for r, i in enumerate(batch):
                    out[i] = (float(logp_host[r]), bool(greedy_host[r]))
                if progress is not None:
                    progress(len(batch))
        self.timings.score_seconds += time.perf_counter() - start
        return out

    def _run(self, model: CausalLM, rows: list[Row], shape: Shape) -> tuple[jax.Array, jax.Array]:
        ids = np.zeros((self.batch_size, shape.width), np.int32)
        mask = np.zeros(ids.shape, bool)
        at = np.zeros((self.batch_size, shape.scored), np.int32)
        targets = np.zeros_like(at)
        scored = np.zeros(at.shape, bool)
        for r, row in enumerate(rows):
            n, c = len(row.ids), row.scored
            ids[r, :n], mask[r, :n] = row.ids, True
            at[r, :c], targets[r, :c], scored[r, :c] = np.arange(n - c, n), row.targets[n - c :], True
        mask[len(rows):, 0] = True  # filler rows: one token, nothing scored
        args = [self._put(a) for a in (ids, mask, at, targets, scored)]
        result: tuple[jax.Array, jax.Array] = self._compiled[shape](model, *args)
        return result

    def _put(self, host: np.ndarray) -> jax.Array:
        """``host`` (the same on every process) on the devices, rows on the batch axes; each process
        places only its devices' part (a mesh spanning processes has devices it cannot reach)."""
        sharding = self._sharding(host.shape[1])
        if sharding is None or sharding.is_fully_addressable:
            placed: jax.Array = jax.device_put(host, sharding)
            return placed
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def _sharding(self, width: int) -> NamedSharding | None:
        if self.mesh is None:
            return None
        return logical_to_sharding(("batch", None), (self.batch_size, width), self.mesh)
