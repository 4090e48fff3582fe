"""A location string is told apart (URL, local path, Hub repo id) on the local file system alone: a
local file or a mistyped path is an immediate ``SourceNotFoundError`` saying what is there, never a
Hub request."""

from __future__ import annotations

from pathlib import Path

import pytest

from otfload.errors import SourceNotFoundError
from otfload.sources import open_source
from otfload.sources.location import MAX_HUB_SEGMENT, Kind, classify_location, could_be_hub_repo_id


@pytest.fixture
def workdir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A current directory holding ``work/tinyqwen/model.safetensors`` (and ``config.json``)."""
    (tmp_path / "work" / "tinyqwen").mkdir(parents=True)
    (tmp_path / "work" / "tinyqwen" / "model.safetensors").write_bytes(b"\x08" + bytes(7) + b"{}      ")
    (tmp_path / "work" / "tinyqwen" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("text", ["Qwen/Qwen3-8B", "meta-llama/Llama-3.1-8B", "org/name_x", "a/b",
                                  "o/" + "n" * MAX_HUB_SEGMENT])
def test_hub_ids_go_to_the_hub(workdir: Path, text: str):
    assert could_be_hub_repo_id(text)
    assert classify_location(text) is Kind.HUB


@pytest.mark.parametrize("text", ["name", "a/b/c", "-org/name", "org/name.", "org/na--me", "org/na..me", "./a",
                                  "~/x", "o/" + "n" * (MAX_HUB_SEGMENT + 1), "org/na me", "org/"])
def test_strings_the_hub_refuses(text: str):
    assert not could_be_hub_repo_id(text)


def test_urls_and_directories(workdir: Path):
    assert classify_location("gs://bucket/model") is Kind.URL
    assert classify_location("work/tinyqwen") is Kind.LOCAL
    assert classify_location(str(workdir / "work")) is Kind.LOCAL


def test_a_file_names_its_directory(workdir: Path):
    with pytest.raises(SourceNotFoundError, match=r"'work/tinyqwen/model.safetensors' is a file.*'work/tinyqwen/'"):
        open_source("work/tinyqwen/model.safetensors")
    absolute = workdir / "work" / "tinyqwen" / "config.json"
    with pytest.raises(SourceNotFoundError, match=f"is a file.*'{workdir / 'work' / 'tinyqwen'}/'"):
        open_source(absolute)


def test_a_mistyped_path_beside_a_local_folder_is_not_a_hub_id(workdir: Path):
    # "work/tinyqwn" is spelt like a repo id, but ./work exists: a path, with the close name offered
    with pytest.raises(SourceNotFoundError) as info:
        open_source("work/tinyqwn")
    message = str(info.value)
    assert "does not exist" in message and "nearest existing parent is 'work/'" in message
    assert "Did you mean 'work/tinyqwen'?" in message
    assert "not tried as a Hub repo id because 'work' exists here" in message
    assert "hf://work/tinyqwn" in message


@pytest.mark.parametrize(("text", "said"), [
    ("tinyqwen/model.safetensors", "file suffix is not tried as a Hub repo id"),  # a file's path from elsewhere
    ("work/tinyqwen/x/y", "nearest existing parent is 'work/tinyqwen/'"),
    ("tinyqwen", "has no 'tinyqwen'. A Hub repo id is org/name"),
    ("./work/tinyqwem", "Did you mean 'work/tinyqwen'?"),
])
def test_missing_paths_say_where_the_path_ends(workdir: Path, text: str, said: str):
    with pytest.raises(SourceNotFoundError, match="does not exist") as info:
        classify_location(text)
    assert said in str(info.value)


def test_absolute_missing_path(tmp_path: Path):
    with pytest.raises(SourceNotFoundError, match=f"nearest existing parent is '{tmp_path}/'"):
        classify_location(str(tmp_path / "absent" / "deeper"))


def test_a_broken_link_says_where_it_points(workdir: Path):
    (workdir / "gone").symlink_to(workdir / "moved-away", target_is_directory=True)
    with pytest.raises(SourceNotFoundError, match=f"'gone' is a symbolic link to '{workdir / 'moved-away'}', which"):
        open_source("gone")
    with pytest.raises(SourceNotFoundError) as info:
        open_source("gone/model")  # a parent is the broken link: no "did you mean" for the name itself
    assert "Did you mean" not in str(info.value)
