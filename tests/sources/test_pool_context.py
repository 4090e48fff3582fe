"""Every pool that runs a load's reads runs them in the load's context: the cancel token and the
fetch meter of the code that asked reach the worker threads (otfload.sources.load_context). Each
pool is driven for real, on a local source that notes what each read's thread sees."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from otfload.accounting.meter import FetchMeter, current_meter, metering
from otfload.cache import ShardCache
from otfload.coordination import LocalCoordinator
from otfload.index.checkpoint import open_index, read_values
from otfload.sources import LocalSource
from otfload.sources.retry import CancelToken, cancel_scope, current_token


class NotingSource(LocalSource):
    """A real local source noting, per read, the thread and the load state it runs with."""

    def __init__(self, root: str | Path) -> None:
        super().__init__(root, mmap=False)
        self.seen: list[tuple[str, CancelToken | None, FetchMeter | None]] = []
        self._lock = threading.Lock()

    def __enter__(self) -> NotingSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _note(self) -> None:
        with self._lock:
            self.seen.append((threading.current_thread().name, current_token(), current_meter()))

    def read_into(self, file, offset, out):
        self._note()
        super().read_into(file, offset, out)

    def read_many(self, reads, *args, **kwargs):
        self._note()
        super().read_many(reads, *args, **kwargs)


def in_pools(source: NotingSource) -> set[tuple[CancelToken | None, FetchMeter | None]]:
    """What the reads made on other threads than this one saw (there must be some)."""
    here = threading.current_thread().name
    states = {(token, meter) for name, token, meter in source.seen if name != here}
    assert states, f"no read ran on a pool thread: {source.seen}"
    return states


def test_header_and_value_reads_run_in_the_loads_context(example_checkpoints):
    token, meter = CancelToken(), FetchMeter()
    with NotingSource(example_checkpoints.quantized) as source, cancel_scope(token), metering(meter):
        index = open_index(source)
        scales = [info for header in index.headers.values() for name, info in header.tensors.items()
                  if name.endswith("weight_scale")]
        values = read_values(source, scales[:4])
    assert len(values) == 4 and all(isinstance(v, np.ndarray) for v in values)
    assert in_pools(source) == {(token, meter)}
    token.cancel()
    assert all(t.cancelled for _, t, _ in source.seen if t is not None)  # the same token: a cancel reaches them


def test_shard_cache_fills_run_in_the_loads_context(example_checkpoints, tmp_path):
    token, meter = CancelToken(), FetchMeter()
    with NotingSource(example_checkpoints.llama) as source, cancel_scope(token), metering(meter):
        ShardCache(source, tmp_path / "cache", coordinator=LocalCoordinator(), owns_source=False).close()
    assert in_pools(source) == {(token, meter)}
    assert meter.bytes > 0  # the fills' fetches were counted on the load's meter


def test_the_lm_eval_background_load_runs_in_the_callers_context(example_checkpoints):
    from otfload.lm_eval.loading import BackgroundLoad

    token = CancelToken()
    with NotingSource(example_checkpoints.llama) as source, cancel_scope(token):
        load = BackgroundLoad(source, progress=False)
        load.model()
    loading = {t for name, t, _ in source.seen if name.startswith("otfload-load")}
    assert len(loading) == 1  # the load's own token (BackgroundLoad.close cancels it), the caller's child
    (seen,) = loading
    assert not seen.cancelled
    token.cancel()
    assert seen.cancelled
