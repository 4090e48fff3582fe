"""Loglikelihood of continuations, batched: what lm_eval's ``loglikelihood`` requests reduce to.

A request is a context and a continuation, both token ids. As in lm_eval's HF backend, the model
reads ``(context + continuation)[-(max_length + 1):][:-1]`` (cut on the left to the context
window) and the continuation's ids are scored by the logits of the positions that predict them:
the sum of their log-softmax values, and whether each is the argmax (``is_greedy``).

Shared contexts are read once. A multiple-choice question is one context and several
continuations (its choices), and lm_eval hands them over as separate requests. Requests with the
same context ids that are not cut (``len(context) + len(continuation) <= max_length + 1``) form
one :class:`Group`: the context, then each continuation but its last id, each a branch that
attends to the context and to its own earlier ids only (:mod:`otfload.models.attention`'s
``segments``), at the positions following the context. Each branch computes exactly what its
request alone would (same keys, same positions); the context's last slot predicts every branch's
first id. A group holds at most ``max_length`` slots, and no more than the model's sliding window
(the window is a distance in slots: a group wider than it would hide other keys than the unpacked
request's); a request that is cut, or does not fit, is a group of its own. On a task of four
choices of ~6 tokens after a ~8-token question this reads about half the tokens.

A model whose rows hold one sequence only (``packs_sequences`` False: a recurrent layer's state and
convolution window run along the whole row, whatever the masks say) is scored one request a row,
as padded rows of its own, without ``segments``: ``make_groups(packs=False)`` and
``Scorer(packs=False)``; a packing scorer given such a model raises
:class:`~otfload.errors.UnsupportedModelError`.

Groups are packed into rows of one width (the longest group's, rounded up to ``ALIGN``), longest
first, each into the row with the most room left (worst-fit decreasing), each group a sequence of
its own there (its segments and prefix apart from the other groups'). Rows are dealt evenly to the
fewest batches of at most ``batch_size`` rows, the job's batch as many rows as the fullest holds
(20 rows at 16 are two batches of 10, not 16 and 4 padded to 16: a filler row costs a full row's
work), a batch's missing rows filled with one masked-in token. So a job has one shape and little
padding, where rows of one request each padded to a few bucket widths had four shapes (a
compilation each) and about a third of padding on that task.

Only the scored positions' hidden states go through the output projection and the softmax
(gathered after the final norm): a continuation is a few tokens of a longer prompt, and the
``[batch, width, vocab]`` logits of every position would cost most of the memory and much of the
time. They are gathered flat, batch-wide (``[scored]`` slot indices into ``[batch * width]``,
padded to the most any batch scores, rounded up to ``ALIGN``), so the projection's work follows
the number of scored tokens; the device returns each scored token's log-probability and argmax
test (log-softmax in float32 whatever the parameter dtype), and the host sums them per request.
The per-token results come back replicated, so that on a mesh spanning several processes (each
driving the same batches) every process reads all of them, and each process places only its own
devices' part of a batch.

Each ``[batch, width]`` shape is compiled ahead of running it, against an abstract model (leaves
as ``jax.ShapeDtypeStruct`` with their shardings) when one is given: the shapes are known from the
requests before the weights are, so compilation overlaps the load. Compile and scoring seconds are
counted apart in :class:`Timings`.
"""
from __future__ import annotations

import contextlib
import heapq
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from otfload.errors import EvalRequestError, UnsupportedModelError
from otfload.lm_eval.buckets import ALIGN
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
    """A batch's rows, its padded width and its scored count (positions of the whole batch that go
    through the output projection)."""

    rows: int
    width: int
    scored: int


@dataclass(frozen=True)
class Group:
    """Requests read together: a context and the continuations packed after it, or one request cut
    to ``max_length``.

    ``ids`` and ``positions`` are the input; ``branches`` each slot's branch (0 the context, ``k``
    the ``k``-th continuation); ``at`` are the slots whose next id is scored and ``targets`` those
    ids, every request's in turn; ``requests`` are the requests' indices and ``counts`` how many
    of ``at`` belong to each."""

    ids: np.ndarray
    positions: np.ndarray
    branches: np.ndarray
    at: np.ndarray
    targets: np.ndarray
    requests: tuple[int, ...]
    counts: tuple[int, ...]


def make_groups(requests: Sequence[tuple[Sequence[int], Sequence[int]]], max_length: int,
                pack_width: int | None = None, *, packs: bool = True) -> list[Group]:
    """The groups answering ``requests`` (``(context ids, continuation ids)``): the continuations
    of one context packed after it in groups of at most ``pack_width`` slots (default
    ``max_length``; a model with a sliding window passes its window), each request alone when it
    is cut to ``max_length`` (lm_eval's rule, see the module docstring), does not fit a pack, or
    ``packs`` is False (a model that packs no sequences)."""
    pack_width = max_length if pack_width is None else min(pack_width, max_length)
    groups: list[Group] = []
    by_context: dict[tuple[int, ...], list[int]] = {}
    for i, (context, continuation) in enumerate(requests):
        _check(context, continuation, max_length)
        if not packs or len(context) + len(continuation) > max_length + 1:
            groups.append(_alone(i, context, continuation, max_length))
        else:
            by_context.setdefault(tuple(context), []).append(i)
    for context, members in by_context.items():
        pack: list[int] = []
        for i in members:
            width = len(context) + sum(len(requests[j][1]) - 1 for j in (*pack, i))
            if pack and width > pack_width:
                groups.append(_packed(context, [(j, requests[j][1]) for j in pack]))
                pack = []
            pack.append(i)
        groups.append(_packed(context, [(j, requests[j][1]) for j in pack]))
    return groups


def _check(context: Sequence[int], continuation: Sequence[int], max_length: int) -> None:
    if not continuation:
        raise EvalRequestError("a loglikelihood request has an empty continuation: nothing to score")
    if not context:
        raise EvalRequestError("a loglikelihood request has no context token (lm_eval puts the prefix token there)")
    if len(continuation) > max_length:
        raise EvalRequestError(f"a continuation of {len(continuation)} tokens does not fit the context window of "
                               f"{max_length} (max_length)")


def _alone(request: int, context: Sequence[int], continuation: Sequence[int], max_length: int) -> Group:
    """One request alone, its input ``(context + continuation)[-(max_length + 1):][:-1]`` (cut to
    ``max_length`` ids when longer)."""
    seq = np.asarray([*context, *continuation], np.int32)[-(max_length + 1):]
    n, c = len(seq) - 1, len(continuation)
    return Group(seq[:-1], np.arange(n, dtype=np.int32), np.zeros(n, np.int32), np.arange(n - c, n, dtype=np.int32),
               seq[n - c + 1 :], (request,), (c,))


def _packed(context: Sequence[int], branches: Sequence[tuple[int, Sequence[int]]]) -> Group:
    """``context`` then each continuation but its last id, branch ``k + 1`` at the
    positions following the context: continuation ``k``'s first id is predicted by the context's
    last slot, its others by its own slots."""
    m = len(context)
    ids, positions, branch_ids, at, targets = [np.asarray(context, np.int32)], [np.arange(m)], [np.zeros(m)], [], []
    slot = m
    for k, (_, continuation) in enumerate(branches):
        n = len(continuation) - 1
        ids.append(np.asarray(continuation[:-1], np.int32))
        positions.append(np.arange(m, m + n))
        branch_ids.append(np.full(n, k + 1))
        at.append(np.asarray([m - 1, *range(slot, slot + n)]))
        targets.append(np.asarray(continuation, np.int32))
        slot += n
    pos, branch, slots, ids_next = (np.concatenate(a).astype(np.int32) for a in (positions, branch_ids, at, targets))
    return Group(np.concatenate(ids), pos, branch, slots, ids_next, tuple(i for i, _ in branches),
                 tuple(len(c) for _, c in branches))


def _loglik_of_batch(model: CausalLM, ids: jax.Array, mask: jax.Array, positions: jax.Array,
                     segments: tuple[jax.Array, jax.Array] | None, at: jax.Array,
                     targets: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The log-probability of each scored target and whether it is the argmax (``[n]`` each).

    ``segments`` are the rows' ``(segment, prefix)`` ids (None: one sequence a row). ``at [n]`` are
    the scored slots of the whole batch (flat indices into ``[b * width]``; padding entries are read
    and ignored), ``targets [n]`` their next ids: only their hidden states go through the output
    projection and the softmax."""
    ctx = make_context(ids, mask, positions, None, model.attention_impl, model.moe_impl, segments)
    hidden, _ = model.forward(ids, ctx, None)
    picked_hidden = hidden.reshape(-1, hidden.shape[-1])[at]
    logits = model.head(picked_hidden[None])[0].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    picked = jnp.take_along_axis(logp, targets[:, None], axis=-1)[:, 0]
    return picked, jnp.argmax(logits, axis=-1) == targets


def spans_processes(mesh: Mesh | None) -> bool:
    """Whether ``mesh`` holds devices of other processes (a replica several processes drive)."""
    return mesh is not None and any(d.process_index != jax.process_index() for d in mesh.devices.flat)


class Scorer:
    """Scores :class:`Group` s in rows of one width, batches of ``batch_size`` rows, compiling each shape once.

    ``abstract`` is the model with ``jax.ShapeDtypeStruct`` leaves (shardings included) to compile
    against before the weights are loaded; ``None`` compiles against the real model when it is
    given. ``mesh`` is the model's mesh (rows go on its batch axes), None for single-device arrays.
    ``packs``: rows hold several groups (segments apart); False: one single-request group a row,
    without segments (a model whose ``packs_sequences`` is False).
    """

    def __init__(self, batch_size: int, max_length: int, mesh: Mesh | None, abstract: CausalLM | None,
                 timings: Timings, packs: bool = True) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1; got {batch_size}")
        self.batch_size, self.max_length, self.mesh, self.abstract = batch_size, max_length, mesh, abstract
        self.packs = packs
        self.timings = timings
        self._compiled: dict[Shape, Any] = {}
        # The scored positions (in) and their two numbers (out) are replicated: every process reads
        # all of them (and on a mesh spanning processes, a row-sharded result could not be read here).
        replicated = None if mesh is None else NamedSharding(mesh, PartitionSpec())  # type: ignore[no-untyped-call]
        self._replicated = replicated
        self._step = CachedJit(_loglik_of_batch, out_shardings=replicated)
        # How many ways a batch's rows are split over the mesh's batch axes: a batch holds a multiple.
        sharding = self._sharding((batch_size, 1))
        self._ways = 1 if sharding is None else batch_size // sharding.shard_shape((batch_size, 1))[0]

    def plan(self, groups: Sequence[Group]) -> list[tuple[list[list[int]], Shape]]:
        """``[(rows, shape)]``: the batches, each at most ``batch_size`` rows of group indices, and
        the one shape of the job (the rows of the fullest batch, a multiple of the mesh's batch
        ways; the longest group rounded up to ``ALIGN``; the most any batch scores, rounded up to
        ``ALIGN``). Groups are placed longest first, each in the row with the most
        room left that holds it, else a new row (worst-fit decreasing: rows fill evenly); rows are
        dealt to the batches most-scored first, back and forth, so that every batch scores about
        as many tokens (the scored count is padded to the most). Without ``packs`` every group
        is a row of its own."""
        if not self.packs and any(len(g.requests) > 1 for g in groups):
            raise ValueError("a group of several requests for a scorer of one request a row: make_groups(packs=False)")
        width = _round_up(max((len(g.ids) for g in groups), default=1))
        rows: list[list[int]] = []
        room: list[tuple[int, int]] = []  # heap of (-free slots, row)
        for i in sorted(range(len(groups)), key=lambda i: -len(groups[i].ids)):
            n = len(groups[i].ids)
            if self.packs and room and -room[0][0] >= n:
                free, r = heapq.heappop(room)
                rows[r].append(i)
                heapq.heappush(room, (free + n, r))
            else:
                rows.append([i])
                heapq.heappush(room, (n - width, len(rows) - 1))
        count = -(-len(rows) // self.batch_size)
        batches: list[list[list[int]]] = [[] for _ in range(count)]
        for k, row in enumerate(sorted(rows, key=lambda row: -sum(len(groups[i].at) for i in row))):
            turn, place = divmod(k, count)
            batches[place if turn % 2 == 0 else count - 1 - place].append(row)
        scored = max((sum(len(groups[i].at) for row in batch for i in row) for batch in batches), default=1)
        fullest = -(-max((len(b) for b in batches), default=1) // self._ways) * self._ways
        shape = Shape(min(fullest, self.batch_size), width, _round_up(scored))
        return [(batch, shape) for batch in batches]

    def compile(self, shapes: Sequence[Shape], model: CausalLM | None = None) -> None:
        """Compile the scoring step for each shape not compiled yet (against the abstract model,
        else ``model``)."""
        target = self.abstract if self.abstract is not None else model
        if target is None:
            raise ValueError("nothing to compile against: no abstract model and no model given")
        for shape in shapes:
            if shape in self._compiled:
                continue
            program = self._step.compile(target, *self._arguments(shape))  # from the kept programs if there
            self._compiled[shape] = program.compiled
            self.timings.compile_seconds += program.seconds
            self.timings.lower_seconds += program.lower_seconds

    def _arguments(self, shape: Shape) -> list[Any]:
        """The step's arguments after the model, abstract: ids, mask, positions ``[batch, width]``
        (rows on the batch axes), segments (``(segment, prefix)`` like them, None without ``packs``),
        scored slots and targets ``[scored]`` (replicated)."""
        rows, flat = (shape.rows, shape.width), (shape.scored,)
        ids, mask, positions, segment, prefix, at, targets = (
            jax.ShapeDtypeStruct(dims, dtype, sharding=self._sharding(dims))  # type: ignore[no-untyped-call]
            for dims, dtype in ((rows, jnp.int32), (rows, jnp.bool_), (rows, jnp.int32), (rows, jnp.int32),
                                (rows, jnp.int32), (flat, jnp.int32), (flat, jnp.int32)))
        return [ids, mask, positions, (segment, prefix) if self.packs else None, at, targets]

    def score(self, groups: Sequence[Group], model: Callable[[], CausalLM],
              progress: Callable[[int], None] | None = None) -> list[tuple[float, bool]]:
        """``(log-probability, is_greedy)`` of each request the groups answer, by request index.
        ``model`` is called once the shapes are compiled (it may wait for the weights);
        ``progress(n)`` after each batch, ``n`` its requests."""
        batches = self.plan(groups)
        shapes = sorted({shape for _, shape in batches})
        if self.abstract is not None:
            self._check_packing(self.abstract)
            self.compile(shapes)
        loaded = model()
        self._check_packing(loaded)
        self.compile(shapes, loaded)
        out: list[tuple[float, bool]] = [(0.0, False)] * sum(len(g.requests) for g in groups)
        start = time.perf_counter()
        with jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext():
            pending = [(b, self._run(loaded, [[groups[i] for i in row] for row in b], shape))
                       for b, shape in batches]  # all dispatched
            for batch, (logp, greedy) in pending:
                answered = [groups[i] for row in batch for i in row]
                counts = [c for g in answered for c in g.counts]
                starts = np.cumsum([0, *counts[:-1]])
                total = sum(counts)
                sums = np.add.reduceat(np.asarray(logp)[:total].astype(np.float64), starts)
                alls = np.logical_and.reduceat(np.asarray(greedy)[:total], starts)
                requests = [i for g in answered for i in g.requests]
                for i, value, is_greedy in zip(requests, sums, alls, strict=True):
                    out[i] = (float(value), bool(is_greedy))
                if progress is not None:
                    progress(len(requests))
        self.timings.score_seconds += time.perf_counter() - start
        return out

    def _check_packing(self, model: CausalLM) -> None:
        if self.packs and not model.packs_sequences:
            raise UnsupportedModelError(f"{type(model).__name__} packs no sequences in a row (a recurrent layer's "
                                        "state runs along it): score it with Scorer(packs=False) and "
                                        "make_groups(packs=False)")

    def _run(self, model: CausalLM, rows: list[list[Group]], shape: Shape) -> tuple[jax.Array, jax.Array]:
        ids = np.zeros((shape.rows, shape.width), np.int32)
        mask = np.zeros(ids.shape, bool)
        positions, segments, prefixes = np.zeros_like(ids), np.zeros_like(ids), np.zeros_like(ids)
        at = np.zeros(shape.scored, np.int32)
        targets = np.zeros_like(at)
        done = 0
        for r, row in enumerate(rows):
            slot, segment = 0, 1  # each group's segments after the previous group's
            for g in row:
                n, c, span = len(g.ids), len(g.at), slice(slot, slot + len(g.ids))
                ids[r, span], mask[r, span], positions[r, span] = g.ids, True, g.positions
                segments[r, span], prefixes[r, span] = segment + g.branches, segment
                at[done : done + c], targets[done : done + c] = r * shape.width + slot + g.at, g.targets
                slot, segment, done = slot + n, segment + int(g.branches.max()) + 1, done + c
        mask[len(rows):, 0] = True  # filler rows: one token, nothing scored
        placed = [self._put(a) for a in (ids, mask, positions)]
        packed = (self._put(segments), self._put(prefixes)) if self.packs else None
        result: tuple[jax.Array, jax.Array] = self._compiled[shape](model, *placed, packed, self._put(at),
                                                                    self._put(targets))
        return result

    def _put(self, host: np.ndarray) -> jax.Array:
        """``host`` (the same on every process) on the devices, rows on the batch axes; each process
        places only its devices' part (a mesh spanning processes has devices it cannot reach)."""
        sharding = self._sharding(host.shape)
        if sharding is None or sharding.is_fully_addressable:
            placed: jax.Array = jax.device_put(host, sharding)
            return placed
        return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])

    def _sharding(self, dims: tuple[int, ...]) -> NamedSharding | None:
        """``[batch, width]`` arrays: rows on the batch axes; ``[scored]``: replicated."""
        if self.mesh is None:
            return None
        if len(dims) == 1:
            return self._replicated
        return logical_to_sharding(("batch", None), dims, self.mesh)


def _round_up(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
