"""open_source dispatch: sources pass through, URLs, local directories, Hub repo ids, and refusals."""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from otfload.errors import SourceNotFoundError, UnsafeFormatError
from otfload.sources import LocalSource, open_source
from otfload.sources.fsspec_source import FsspecSource
from otfload.sources.hub import HubSource


def test_source_passes_through(checkpoint: Path):
    src = LocalSource(checkpoint)
    assert open_source(src) is src


def test_local_directory(checkpoint: Path):
    assert isinstance(open_source(checkpoint), LocalSource)
    assert isinstance(open_source(str(checkpoint)), LocalSource)


def test_urls_go_to_fsspec(checkpoint: Path, gcs_server, fast_retry):
    url = gcs_server.upload_dir(checkpoint, "open-source", "m")
    src = open_source(url, storage_options=gcs_server.storage_options, retry=fast_retry)
    assert isinstance(src, FsspecSource) and "config.json" in src.list_files()
    assert isinstance(open_source(checkpoint.as_uri()), FsspecSource)
    fsspec.filesystem("memory").pipe_file("memory://open-source/a.safetensors", b"12345678")
    assert open_source("memory://open-source").list_files() == ["a.safetensors"]


def test_hub_repo_id(checkpoint: Path, hub, tmp_path: Path, fast_retry):
    hub.add_repo("org/opened", checkpoint)
    src = open_source("org/opened", endpoint=hub.url, cache_dir=tmp_path, revision="main", retry=fast_retry)
    assert isinstance(src, HubSource) and src.commit == hub.commit("org/opened")
    with pytest.raises(SourceNotFoundError, match="org/absent"):
        open_source("org/absent", endpoint=hub.url, cache_dir=tmp_path, retry=fast_retry)


@pytest.mark.parametrize("location", ["./no/such/dir", "/no/such/dir", "no-slash-name", "a/b/c"])
def test_nonexistent_locations(location: str):
    with pytest.raises(SourceNotFoundError):
        open_source(location)


def test_pickle_only_checkpoints_are_refused(pickle_checkpoint: Path, hub, tmp_path: Path, fast_retry):
    with pytest.raises(UnsafeFormatError, match="safetensors"):
        open_source(pickle_checkpoint)
    hub.add_repo("org/pickle-only", pickle_checkpoint)
    with pytest.raises(UnsafeFormatError, match="safetensors"):
        open_source("org/pickle-only", endpoint=hub.url, cache_dir=tmp_path, retry=fast_retry)


def test_unknown_option_is_refused(tmp_path):
    with pytest.raises(TypeError, match="revison"):
        open_source(tmp_path, revison="main")


def test_local_mmap_option(tmp_path):
    assert open_source(tmp_path, mmap=False).use_mmap is False
    assert open_source(tmp_path).use_mmap is True
