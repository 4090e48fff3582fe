"""Writing an export from every process of a ``jax.distributed`` job into one shared directory.

The shard files (split as ``save_pretrained`` splits them) are assigned to processes, balanced
by bytes (:func:`otfload.coordination.assign_files`: the same answer everywhere, without talking). Every
process then walks every tensor of every file in the same order. A leaf slice that the owner of
its file holds completely on its own devices is copied by the owner alone; any other slice is
gathered with :func:`jax.experimental.multihost_utils.process_allgather`, which every process
joins, and only the owner keeps it. Host memory thus holds one HF tensor (and one slice) at a
time, never the model.

The output must be on a file system all processes share. Process 0 creates the temporary
directory beside the target; after a barrier each owner writes its files into it; after a second
barrier process 0 writes the index, ``config.json`` and the companion files (tokenizer, generation
config) and renames the directory into place; a last barrier lets every process return only once
the output exists. In a one-process run the barriers are skipped and no collective is ever needed.
"""

from __future__ import annotations

import math
import os
import secrets
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import jax
import numpy as np
from jax.experimental import multihost_utils

from otfload.atomic import commit, output_dir, temp_path
from otfload.coordination import assign_files
from otfload.export import writer
from otfload.export.companions import write_companions
from otfload.export.gather import Position, contains, device_slice, gather_slice
from otfload.export.inverse import Fetch
from otfload.export.job import ExportJob

Box = tuple[tuple[int, int], ...]


def process_boxes(array: jax.Array) -> dict[int, set[Box]]:
    """Process index → the distinct index boxes its devices hold of the global ``array``."""
    boxes: dict[int, set[Box]] = {}
    for device, index in array.sharding.devices_indices_map(array.shape).items():
        box = tuple(s.indices(n)[:2] for s, n in zip(index, array.shape, strict=True))
        boxes.setdefault(device.process_index, set()).add(box)  # type: ignore[attr-defined]  # jaxlib's Device
    return boxes


def holds(boxes: set[Box], shape: tuple[int, ...], index: Position) -> bool:
    """Whether ``boxes`` (one process's, of an array of ``shape``) cover all of ``array[index]``."""
    kept = [d for d in range(len(shape)) if d >= len(index) or index[d] is None]
    inside = {tuple(box[d] for d in kept) for box in boxes if contains(box, index)}
    return sum(math.prod(b - a for a, b in box) for box in inside) == math.prod(shape[d] for d in kept)


class _Fetcher:
    """The ``fetch`` of one process for the slices of one file (owned by ``owner``): a host copy
    for the owner, ``None`` elsewhere; joins the collective of every slice the owner lacks."""

    def __init__(self, arrays: Mapping[str, Any], me: int):
        self.arrays, self.me = arrays, me
        self._boxes: dict[str, dict[int, set[Box]] | None] = {}

    def _local_to(self, leaf: str, owner: int, index: Position) -> bool:
        array = self.arrays[leaf]
        if leaf not in self._boxes:
            fully = not isinstance(array, jax.Array) or array.is_fully_addressable
            self._boxes[leaf] = None if fully else process_boxes(array)
        boxes = self._boxes[leaf]
        return boxes is None or holds(boxes.get(owner, set()), array.shape, index)

    def for_owner(self, owner: int) -> Callable[[str, Position], np.ndarray | None]:
        def fetch(leaf: str, index: Position) -> np.ndarray | None:
            array = self.arrays[leaf]
            if self._local_to(leaf, owner, index):
                return gather_slice(array, index) if owner == self.me else None
            host = multihost_utils.process_allgather(device_slice(array, index), tiled=True)
            return np.asarray(host) if owner == self.me else None

        return fetch


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def _shared_token() -> str:
    """A random name suffix, the same in every process."""
    token = np.asarray(secrets.randbits(31), np.int32)
    if jax.process_count() > 1:
        token = multihost_utils.broadcast_one_to_all(token)
    return f"{int(token):08x}"


def write_export(
    job: ExportJob,
    arrays: Mapping[str, Any],
    out_dir: str | os.PathLike[str],
    *,
    max_shard_size: int | str,
    overwrite: bool,
    companions: Mapping[str, bytes] | None = None,
    progress: bool | None = None,
) -> Path:
    """Write ``job`` from ``arrays`` (dotted leaf path → array) to ``out_dir``, atomically, with the
    ``companions`` files (name → bytes: the tokenizer's, ...) beside them; every process of the job
    must call it with the same arguments. ``progress``: a bar of the bytes this process writes
    (:func:`~otfload.export.writer.write_progress`)."""
    me = jax.process_index()
    target = output_dir(out_dir, overwrite)
    files = writer.plan_shards(job.specs, max_shard_size)
    owners = assign_files({name: sum(s.nbytes for s in shard) for name, shard in files.items()}, jax.process_count())
    token = _shared_token()
    tmp = temp_path(target, token)
    if me == 0:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp.mkdir()
    try:
        _barrier(f"otfload-export-{token}-start")
        fetcher = _Fetcher(arrays, me)
        mine = sum(s.nbytes for name, shard in files.items() if owners[name] == me for s in shard)
        with writer.write_progress(mine, progress) as bar:
            for name, shard in files.items():
                fetch = fetcher.for_owner(owners[name])
                if owners[name] == me:  # the owner's fetch: never None
                    writer.write_safetensors(tmp / name, shard, job.producer(cast(Fetch, fetch)), bar.update)
                    continue
                for spec in shard:
                    for leaf, index in job.plan.tensors[spec.key].sources:
                        fetch(leaf, index)
        _barrier(f"otfload-export-{token}-written")
        if me == 0:
            writer.write_index(tmp, files)
            writer.write_config(tmp, job.config)
            write_companions(tmp, companions or {})
            commit(tmp, target)
        _barrier(f"otfload-export-{token}-done")
    except BaseException:
        if me == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target
