"""The checkpoint for an eval job: tokenizer and abstract model at once, the weights on a thread.

An eval job's first seconds go to three things that do not depend on each other: reading the
weights, building the task's requests, and compiling the scoring step for the requests' shapes.
Compiling needs only the model's structure, leaf shapes, dtypes and shardings, which the plan
knows from the safetensors headers before any tensor byte is read. So :class:`BackgroundLoad`
plans the model (:func:`~otfload.api.plan_model`), reads the tokenizer, then starts
:func:`~otfload.api.from_pretrained` on a thread and returns: the caller builds its requests and
compiles against :attr:`BackgroundLoad.abstract` while the bytes arrive, and :meth:`model` waits
for them only when the first batch runs.

The abstract model is the planned module with each parameter a ``jax.ShapeDtypeStruct`` carrying
the sharding the plan places it with, which is what the loaded model's arrays have, so an
executable compiled for one runs the other. Where the loaded model's parameters differ from the
planned leaves (``quantized="keep"``, LoRA factors kept) there is no abstract model and scoring
compiles once the weights are in.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import os
import time
from typing import Any

import jax
from flax import nnx

from otfload.api import from_pretrained, plan_model
from otfload.lm_eval.tokens import CheckpointTokenizer, checkpoint_tokenizer
from otfload.models.base import CausalLM
from otfload.options import LoadOptions, resolve_options
from otfload.plan.abstract import dotted
from otfload.plan.planner import LoadPlan
from otfload.sources.base import Source
from otfload.sources.load_context import submit
from otfload.sources.owned import owned, owned_source
from otfload.sources.retry import CancelToken, cancel_scope, current_token


class BackgroundLoad:
    """``from_pretrained(location, options=options, **keywords)`` running on a thread, with what is
    known before it ends. ``keywords`` are :class:`~otfload.options.LoadOptions` fields by name (as
    lm_eval's ``model_args`` give them, with the backend's ``mesh`` and ``progress``)."""

    def __init__(self, location: str | os.PathLike[str] | Source, *, options: LoadOptions | None = None,
                 **keywords: Any) -> None:
        self.start = time.perf_counter()
        self.seconds: float | None = None  # from this call to the end of the weights' load, once it has ended
        load_options = resolve_options(options, keywords)
        self._stack = contextlib.ExitStack()
        try:
            self.source = self._stack.enter_context(owned_source(location, **load_options.source_options()))
            abstract, plan, planned = plan_model(self.source, options=load_options)
            with owned(planned, self.source):  # a source the plan wrapped around ours (adapters, shard cache)
                self.config: dict[str, Any] = plan.config
                self.tokenizer: CheckpointTokenizer = checkpoint_tokenizer(self.source, plan.config)
            self.sliding_window = _sliding_window(abstract)
            self.packs_sequences = bool(getattr(abstract, "packs_sequences", True))  # one sequence a row when False
            same_leaves = load_options.quantized != "keep" and load_options.merge_adapter
            self.abstract: CausalLM | None = _with_shardings(abstract, plan) if same_leaves else None
            self._token = CancelToken(current_token())  # the caller's token cancels the load too
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="otfload-load")
            self._future: concurrent.futures.Future[Any] = submit(self._pool, self._run, load_options)
        except BaseException:
            self._stack.close()
            raise

    def _run(self, load_options: LoadOptions) -> Any:
        try:
            with cancel_scope(self._token):
                return from_pretrained(self.source, options=load_options)
        finally:
            self.seconds = time.perf_counter() - self.start

    def close(self) -> None:
        """Stop the load if it still runs (its reads cancelled) and close its source: for a job
        that ends before it needs the weights (e.g. the checkpoint's tokenizer refused)."""
        self._token.cancel()
        with contextlib.suppress(BaseException):  # the load's own end: cancelled, or what it raised
            self._future.result()
        self._pool.shutdown()
        self._stack.close()

    def model(self) -> CausalLM:
        """The loaded model (waits for the load; raises what it raised)."""
        try:
            model = self._future.result()
        finally:
            self._pool.shutdown()
            self._stack.close()  # idempotent: an ExitStack closes its contexts once
        assert isinstance(model, CausalLM)  # from_pretrained builds a bundled family model
        return model


def _sliding_window(model: nnx.Module) -> int | None:
    """The model's sliding window (None: full attention), which bounds a packed scoring group."""
    window = getattr(getattr(model, "cfg", None), "sliding_window", None)
    return int(window) if window else None


def _with_shardings(model: nnx.Module, plan: LoadPlan) -> CausalLM:
    """The abstract ``model`` with each parameter a ``jax.ShapeDtypeStruct`` of its planned leaf."""
    def struct(path: tuple[Any, ...]) -> jax.ShapeDtypeStruct:
        leaf = plan.leaves[dotted(path)].leaf
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=leaf.sharding)  # type: ignore[no-untyped-call]

    flat = [(path, var.replace(struct(path))) for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))]
    nnx.update(model, nnx.from_flat_state(flat))
    assert isinstance(model, CausalLM)  # plan_model builds a bundled family model
    return model
