"""Whoever opens a source closes it: a load with adapters over a caller's source puts a shard cache
in front of that source (a new source the load owns) and must close it, on success and on error,
while the caller's own source stays open. Checked on real descriptors: the files under the cache
directory this process still holds open (``/proc/self/fd``)."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import pytest

import otfload
from otfload.errors import AdapterError
from otfload.sources import open_source, read_bytes
from tests.adapters.test_sources import check

FD_DIR = Path("/proc/self/fd")
pytestmark = pytest.mark.skipif(not FD_DIR.is_dir(), reason="counts descriptors through /proc/self/fd")


@pytest.fixture(scope="module")
def llama_adapter(peft_adapters):
    return peft_adapters("llama_patterns")


def open_fds_under(root: Path) -> list[str]:
    """The files under ``root`` this process holds a descriptor of (mappings hold one each)."""
    gc.collect()  # a mapping kept only by garbage is not a leak
    found = []
    for fd in os.listdir(FD_DIR):
        try:
            target = os.readlink(FD_DIR / fd)
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(f"{root}{os.sep}"):
            found.append(target)
    return found


def test_cache_around_a_callers_source_is_closed_after_the_load(llama_adapter, tmp_path, mesh_2x4):
    path, torch_model, (adapter,) = llama_adapter
    cache = tmp_path / "cache"
    base = open_source(path.as_uri())  # a remote-style (fsspec) source: the load wraps it in a shard cache
    try:
        model, report = otfload.from_pretrained(base, adapter=adapter, shard_cache=cache, mesh=mesh_2x4,
                                                return_report=True)
        check(model, torch_model, adapter)
        assert "cached in" in report.source  # the reads went through the cache
        assert any(cache.rglob("*.safetensors"))
        assert open_fds_under(cache) == []
        assert read_bytes(base, "config.json") == (path / "config.json").read_bytes()  # the caller's: still open
    finally:
        base.close()


def test_cache_around_a_callers_source_is_closed_when_the_load_fails(llama_adapter, tmp_path):
    path, _, _ = llama_adapter
    cache = tmp_path / "cache"
    base = open_source(path.as_uri())
    try:
        # The base's headers are read through the cache, then the "adapter" (a model) is refused.
        with pytest.raises(AdapterError, match="no adapter_config.json"):
            otfload.plan_model(base, adapter=path, shard_cache=cache)
        assert any(cache.rglob("*.safetensors"))
        assert open_fds_under(cache) == []
        assert read_bytes(base, "config.json") == (path / "config.json").read_bytes()
    finally:
        base.close()


def test_plan_model_source_is_owned_by_the_caller_to_close(llama_adapter, tmp_path):
    """plan_model hands back a source it made around the caller's: closing it (the owned() rule) frees
    the cache and leaves the caller's source open."""
    from otfload.sources.owned import owned

    path, _, (adapter,) = llama_adapter
    cache = tmp_path / "cache"
    base = open_source(path.as_uri())
    try:
        _, plan, src = otfload.plan_model(base, adapter=adapter, shard_cache=cache)
        assert src is not base
        with owned(src, base):
            read_bytes(src, plan.leaves[next(iter(plan.leaves))].sources[0].file, 0, 8)
        assert open_fds_under(cache) == []
        assert read_bytes(base, "config.json") == (path / "config.json").read_bytes()
    finally:
        base.close()
