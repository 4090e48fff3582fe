"""Who closes a source: a :class:`Source` the caller passes in is never closed by otfload; one opened
from a path is closed before the call returns, on success and on error. Closing is observed on real
sources: a :class:`LocalSource` that counts its ``close()`` calls, and this process's open descriptors."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import jax
import pytest

import otfload
from otfload.cache.shard_cache import ShardCache
from otfload.cli.inspect import inspect_source
from otfload.coordination import LocalCoordinator
from otfload.errors import CheckpointMismatchError
from otfload.export.api import export_checkpoint, export_hf
from otfload.mappings.pytree_llama import TABLE, abstract_params
from otfload.plan.mapping import MappingTable
from otfload.sources import LocalSource
from otfload.sources.owned import is_owned, owned, owned_source


class CountingSource(LocalSource):
    """A real local source that counts how often it was closed."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        super().__init__(root)
        self.closes = 0

    def close(self) -> None:
        self.closes += 1
        super().close()


def open_fds() -> set[str]:
    """The targets of this process's open descriptors (files, sockets, ...)."""
    fds = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the descriptor listdir itself used, gone already
            fds.add(os.readlink(f"/proc/self/fd/{fd}"))
    return fds


def checkpoint_fds(path: Path) -> set[str]:
    """Open descriptors on files of the checkpoint at ``path``."""
    root = str(path.resolve())
    return {fd for fd in open_fds() if fd.startswith(root)}


@pytest.fixture(scope="module")
def llama(tiny_checkpoints, tmp_path_factory) -> Path:
    """A copy of the tiny Llama that only these tests open: descriptors on it are theirs alone."""
    return Path(shutil.copytree(tiny_checkpoints("llama")[0], tmp_path_factory.mktemp("owned") / "llama"))


def test_owned_closes_only_what_the_call_opened(llama):
    given = CountingSource(llama)
    with owned(given, given) as src:
        assert src is given and not is_owned(src, given)
    assert given.closes == 0
    opened = CountingSource(llama)
    with pytest.raises(RuntimeError), owned(opened, str(llama)):
        raise RuntimeError("the block failed")
    assert opened.closes == 1 and is_owned(opened, str(llama))


def test_owned_source_closes_a_path_on_error_and_keeps_a_source(llama):
    with pytest.raises(RuntimeError), owned_source(llama) as src:
        src.size("config.json")
        assert checkpoint_fds(llama)  # the pool holds the file open inside the block
        raise RuntimeError("the block failed")
    assert not checkpoint_fds(llama)
    given = CountingSource(llama)
    with owned_source(given) as src:
        assert src is given
    assert given.closes == 0


def test_a_callers_source_stays_open_after_load_plan_inspect_and_export(llama, mesh_2x4, tmp_path):
    given = CountingSource(llama)
    model = otfload.from_pretrained(given, mesh=mesh_2x4)
    _, _, src = otfload.plan_model(given, mesh=mesh_2x4)
    assert src is given
    with jax.set_mesh(mesh_2x4):
        abstract = abstract_params(given_config(given), mesh_2x4)
    otfload.load_params(given, abstract, TABLE, mesh=mesh_2x4)
    otfload.plan_params(given, abstract, TABLE, mesh=mesh_2x4)
    inspect_source(given, mesh=mesh_2x4)
    export_hf(model, tmp_path / "a", reference=given)
    export_checkpoint(given, tmp_path / "b", mesh=mesh_2x4)
    assert given.closes == 0
    assert given.open_files > 0  # still holding its files: nobody closed it behind the caller's back
    assert given.size("config.json") == (llama / "config.json").stat().st_size
    given.close()  # the caller's to close
    assert not checkpoint_fds(llama)


def given_config(source: LocalSource) -> dict:
    return json.loads((source.root / "config.json").read_text())


def test_a_source_opened_from_a_path_is_closed(llama, mesh_2x4, tmp_path):
    assert not checkpoint_fds(llama)
    model = otfload.from_pretrained(llama, mesh=mesh_2x4)
    assert not checkpoint_fds(llama)
    with jax.set_mesh(mesh_2x4):
        abstract = abstract_params(given_config(LocalSource(llama)), mesh_2x4)
    otfload.load_params(llama, abstract, TABLE, mesh=mesh_2x4)
    otfload.plan_params(llama, abstract, TABLE, mesh=mesh_2x4)
    inspect_source(str(llama), mesh=mesh_2x4)
    export_hf(model, tmp_path / "a", reference=llama)  # read the reference's headers, then closed it
    export_checkpoint(llama, tmp_path / "b", mesh=mesh_2x4)
    assert not checkpoint_fds(llama)


def test_a_source_opened_from_a_path_is_closed_when_planning_fails(llama, mesh_2x4):
    with jax.set_mesh(mesh_2x4):
        abstract = abstract_params(given_config(LocalSource(llama)), mesh_2x4)
    partial = MappingTable(rules=TABLE.rules[1:], ignore=TABLE.ignore)  # no rule for embed_tokens
    with pytest.raises(CheckpointMismatchError, match="embed_tokens"):
        otfload.load_params(llama, abstract, partial, mesh=mesh_2x4)
    assert not checkpoint_fds(llama)


def test_a_shard_cache_around_a_callers_source_leaves_it_open(llama, tmp_path):
    given = CountingSource(llama)
    cache = ShardCache(given, tmp_path / "cache", coordinator=LocalCoordinator(), owns_source=False)
    cache.close()
    assert given.closes == 0
    opened = CountingSource(llama)
    ShardCache(opened, tmp_path / "cache", coordinator=LocalCoordinator()).close()
    assert opened.closes == 1
