"""Loglikelihood of continuations, batched: what lm_eval's ``loglikelihood`` requests reduce to.

A request is a context and a continuation, both token ids. As in lm_eval's HF backend, the model
reads ``(context + continuation)[-(max_length + 1):][:-1]`` (cut on the left to the context
window) and the continuation's ids are scored by the logits of the positions that predict them:
the sum of their log-softmax values, and whether each is the argmax (``is_greedy``).

Rows are sorted longest first (lm_eval's order) and cut into batches of ``batch_size``; each batch
is padded on the right to one of a few widths chosen from the batches' lengths
(:mod:`otfload.lm_eval.buckets`) and its missing rows are filled with one masked-in token. The
device computes per row only the two numbers lm_eval keeps (log-softmax in float32 whatever the
parameter dtype), so no ``[batch, width, vocab]`` array comes back to the host.

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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from otfload.errors import EvalRequestError
from otfload.lm_eval.buckets import choose_widths, width_for
from otfload.models.base import CausalLM
from otfload.plan.sharding import logical_to_sharding

# A token-level request as lm_eval's TemplateLM hands it over: ((context, continuation) strings or
# None for rolling windows, context ids, continuation ids).
TokenRequest = tuple[Any, Sequence[int], Sequence[int]]


@dataclass
class Timings:
    """Seconds spent, summed over the job: loading (tokenizer, plan, weights: the wall time of the
    load, which overlaps compilation), compiling, scoring and generating."""

    load_seconds: float = 0.0
    compile_seconds: float = 0.0
    score_seconds: float = 0.0
    generate_seconds: float = 0.0

    def to_dict(self) -> dict[str, float]:
        return {"load_seconds": self.load_seconds, "compile_seconds": self.compile_seconds,
                "score_seconds": self.score_seconds, "generate_seconds": self.generate_seconds}


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


def _loglik_of_batch(model: CausalLM, ids: jax.Array, mask: jax.Array, targets: jax.Array,
                     scored: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per row: the summed log-probability of the scored targets, and whether each is the argmax."""
    out = model(ids, attention_mask=mask)
    assert not isinstance(out, tuple)  # without a cache the model returns the logits alone
    logits = out.astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
    greedy = jnp.argmax(logits, axis=-1) == targets
    return jnp.where(scored, picked, 0.0).sum(-1), (greedy | ~scored).all(-1)


_loglik = jax.jit(_loglik_of_batch)


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
        self._compiled: dict[tuple[int, int], Any] = {}

    def plan(self, rows: Sequence[Row]) -> list[tuple[list[int], int]]:
        """``[(row indices, width)]``: the batches, longest rows first, and each one's padded width."""
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i].ids))
        batches = [order[i : i + self.batch_size] for i in range(0, len(order), self.batch_size)]
        widths = choose_widths([len(rows[b[0]].ids) for b in batches], self.max_length)
        return [(b, width_for(len(rows[b[0]].ids), widths)) for b in batches]

    def compile(self, widths: Sequence[int], model: CausalLM | None = None) -> None:
        """Compile the scoring step for each width not compiled yet (against the abstract model,
        else ``model``)."""
        target = self.abstract if self.abstract is not None else model
        if target is None:
            raise ValueError("nothing to compile against: no abstract model and no model given")
        for width in widths:
            if (self.batch_size, width) in self._compiled:
                continue
            start = time.perf_counter()
            sharding = self._sharding(width)
            ids = jax.ShapeDtypeStruct((self.batch_size, width), jnp.int32, sharding=sharding)  # type: ignore[no-untyped-call]
            mask = jax.ShapeDtypeStruct(ids.shape, jnp.bool_, sharding=sharding)  # type: ignore[no-untyped-call]
            self._compiled[(self.batch_size, width)] = _loglik.lower(target, ids, mask, ids, mask).compile()
            self.timings.compile_seconds += time.perf_counter() - start

    def score(self, rows: Sequence[Row], model: Callable[[], CausalLM],
              progress: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
        """``(log-probability, is_greedy)`` of each row, in the order given. ``model`` is called
        once the shapes are compiled (it may wait for the weights); ``progress(n)`` after each batch."""
        batches = self.plan(rows)
        if self.abstract is not None:
            self.compile(sorted({w for _, w in batches}))
        loaded = model()
        self.compile(sorted({w for _, w in batches}), loaded)
        out: list[tuple[float, bool]] = [(0.0, False)] * len(rows)
        start = time.perf_counter()
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            pending = [(b, self._run(loaded, [rows[i] for i in b], w)) for b, w in batches]  # all dispatched
            for batch, (logp, greedy) in pending:
                logp_host, greedy_host = np.asarray(logp), np.asarray(greedy)
                for r, i in enumerate(batch):
                    out[i] = (float(logp_host[r]), bool(greedy_host[r]))
                if progress is not None:
                    progress(len(batch))
        self.timings.score_seconds += time.perf_counter() - start
        return out

    def _run(self, model: CausalLM, rows: list[Row], width: int) -> tuple[jax.Array, jax.Array]:
        ids = np.zeros((self.batch_size, width), np.int32)
        targets = np.zeros_like(ids)
        mask = np.zeros(ids.shape, bool)
        scored = np.zeros(ids.shape, bool)
        for r, row in enumerate(rows):
            n = len(row.ids)
            ids[r, :n], targets[r, :n], mask[r, :n] = row.ids, row.targets, True
            scored[r, n - row.scored : n] = True
        mask[len(rows):, 0] = True  # filler rows: one token, nothing scored
        args = [jax.device_put(a, self._sharding(width)) for a in (ids, mask, targets, scored)]
        result: tuple[jax.Array, jax.Array] = self._compiled[(self.batch_size, width)](model, *args)
        return result

    def _sharding(self, width: int) -> NamedSharding | None:
        if self.mesh is None:
            return None
        return logical_to_sharding(("batch", None), (self.batch_size, width), self.mesh)
