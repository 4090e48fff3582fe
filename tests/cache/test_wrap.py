"""The ``verify=`` option end to end: validated up front, threaded from ``from_pretrained`` to the
shard cache, and applied to the single-host HF-cache route too."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.cache import ShardCache, cache_key, wrap_with_cache
from otfload.errors import CacheIntegrityError
from otfload.sources.hub import HubSource
from tests.cache.conftest import SHARD
from tests.servers.hub_server import HubServer

LLAMA_REPO = "org/llama-verify"


def _params(model: nnx.Module) -> dict[str, np.ndarray]:
    return {".".join(map(str, p)): np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_an_unknown_verify_mode_is_refused_before_anything_is_opened(files_dir: Path, tmp_path: Path):
    with pytest.raises(ValueError, match="verify='fast'"):
        otfload.from_pretrained(files_dir, shard_cache=tmp_path / "c", verify="fast")
    with pytest.raises(ValueError, match="expected one of 'record', 'full'"):
        wrap_with_cache(otfload.sources.open_source(files_dir), None, verify="")  # checked even with no cache
    assert not (tmp_path / "c").exists()


def test_from_pretrained_with_full_verification_never_loads_changed_cached_bytes(
    tiny_checkpoints, hub: HubServer, mesh_2x4, tmp_path: Path
):
    llama = tiny_checkpoints("llama")[0]
    repo = hub.add_repo(LLAMA_REPO, llama)
    options = dict(endpoint=hub.url, cache_dir=tmp_path / "hf", mesh=mesh_2x4, shard_cache=tmp_path / "cache")
    reference = _params(otfload.from_pretrained(llama, mesh=mesh_2x4))
    otfload.from_pretrained(repo, **options)
    folder = tmp_path / "cache" / cache_key(HubSource(repo, endpoint=hub.url, cache_dir=tmp_path / "hf"))
    shard = max(folder.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[-4:] = b"\x7f\x7f\x7f\x7f"  # the last weight: now a huge float
    shard.write_bytes(bytes(data))
    record = json.loads((folder / f"{shard.name}.sha256").read_text())
    stat = shard.stat()
    record["stamp"] = {"mtime_ns": str(stat.st_mtime_ns), "ctime_ns": str(stat.st_ctime_ns)}
    (folder / f"{shard.name}.sha256").write_text(json.dumps(record))  # a record that hides the change

    model = otfload.from_pretrained(repo, verify="full", **options)
    loaded = _params(model)
    assert loaded.keys() == reference.keys()
    assert all(np.array_equal(loaded[k], reference[k]) for k in reference)
    assert shard.read_bytes() == (llama / shard.name).read_bytes()  # fetched again


def test_the_single_host_hf_cache_route_rehashes_with_full_verification(open_hub, tmp_path: Path):
    source = wrap_with_cache(open_hub(), True, verify="full")  # downloads into the HF cache, all verified
    assert isinstance(source, HubSource) and not isinstance(source, ShardCache)
    [blob] = [p for p in (tmp_path / "hf").rglob(SHARD)]
    data = bytearray(blob.read_bytes())
    data[10] ^= 1
    blob.resolve().write_bytes(bytes(data))
    assert wrap_with_cache(open_hub(), True) is not None  # "record": the HF cache is trusted as it is
    with pytest.raises(CacheIntegrityError, match=f"cached copy of {SHARD}"):
        wrap_with_cache(open_hub(), True, verify="full")


def _open_descriptors() -> dict[str, int]:
    """This process's open descriptors by kind (``socket``, ``file``, ...), garbage collected first."""
    import gc
    import os

    gc.collect()
    kinds: dict[str, int] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except FileNotFoundError:  # the descriptor listdir itself used
            continue
        kind = "file" if target.startswith("/") else target.split(":", 1)[0]
        kinds[kind] = kinds.get(kind, 0) + 1
    return kinds


def test_a_load_through_the_shard_cache_leaves_no_descriptor_open(
    tiny_checkpoints, hub: HubServer, mesh_2x4, tmp_path: Path
):
    """Filling the cache, then reusing it: every cached file and every Hub connection the loads opened
    is closed when they return (counted in /proc/self/fd, after one load has made the process-wide
    pools: huggingface_hub's session keeps its connections). Left open, each load would hold the
    cache's 12 shard files."""
    repo = hub.add_repo("org/llama-descriptors", tiny_checkpoints("llama")[0])
    options = dict(endpoint=hub.url, cache_dir=tmp_path / "hf", mesh=mesh_2x4)
    otfload.from_pretrained(repo, shard_cache=tmp_path / "warm", **options)
    before = _open_descriptors()
    otfload.from_pretrained(repo, shard_cache=tmp_path / "cache", **options)  # fills
    otfload.from_pretrained(repo, shard_cache=tmp_path / "cache", **options)  # reuses
    after = _open_descriptors()
    sockets = after.pop("socket", 0), before.pop("socket", 0)
    assert after == before and sockets[0] <= sockets[1]  # pooled connections come and go, never pile up
