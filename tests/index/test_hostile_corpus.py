"""The committed corpus of hostile files (safetensors files, and config.json files loaded with the tiny
test checkpoints): each raises its expected typed error, and the script rebuilds it exactly."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

import otfload
from otfload import errors
from otfload.index.header import read_header
from otfload.sources import LocalSource
from tests.config.support import copy_checkpoint
from tests.index.support import RecordingSource

CORPUS = Path(__file__).parent / "hostile_corpus"
CONFIGS = CORPUS / "configs"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_hostile_corpus.py"
EXPECTED: dict[str, dict] = json.loads((CORPUS / "expected.json").read_text())
CONFIG_EXPECTED: dict[str, dict] = json.loads((CONFIGS / "expected.json").read_text())
# Config validation reads config.json and headers only: each case fails well within this.
CONFIG_CASE_S = 1.0


@pytest.fixture(scope="module")
def source() -> Iterator[RecordingSource]:
    with contextlib.closing(RecordingSource(LocalSource(CORPUS))) as recording:
        yield recording


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_corpus_file_raises_its_expected_error(source: RecordingSource, name: str):
    want = EXPECTED[name]
    if want["error"] is None:
        assert read_header(source, name).tensors
    else:
        error_class = getattr(errors, want["error"])
        assert issubclass(error_class, errors.CorruptFileError)
        with pytest.raises(error_class) as caught:
            read_header(source, name)
        assert type(caught.value) is error_class and caught.value.file == name
        assert want["message"] in str(caught.value)
    assert not source.out_of_bounds()


@pytest.mark.parametrize("name", sorted(CONFIG_EXPECTED))
def test_corpus_config_raises_its_expected_error(tiny_checkpoints, tmp_path: Path, name: str):
    want = CONFIG_EXPECTED[name]
    path = copy_checkpoint(tiny_checkpoints, tmp_path / "ckpt", want["base"])
    shutil.copyfile(CONFIGS / name, path / "config.json")
    start = time.perf_counter()
    if want["error"] is None:
        _, plan, src = otfload.plan_model(path)
        src.close()
        assert plan.leaves and not plan.unused
        return
    error_class = getattr(errors, want["error"])
    with pytest.raises(error_class) as caught:
        otfload.plan_model(path)
    assert time.perf_counter() - start < CONFIG_CASE_S
    assert type(caught.value) is error_class and want["message"] in str(caught.value)
    if want["field"] is not None:
        assert caught.value.field == want["field"] and f"{want['field']} = " in str(caught.value)


def test_every_corpus_file_has_an_expectation():
    assert {p.name for p in CORPUS.iterdir()} == set(EXPECTED) | {"expected.json", "configs"}
    assert {p.name for p in CONFIGS.iterdir()} == set(CONFIG_EXPECTED) | {"expected.json"}
    assert sum(p.stat().st_size for p in CORPUS.rglob("*") if p.is_file()) < 400_000


def test_script_regenerates_the_corpus_byte_for_byte(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("make_hostile_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_corpus(tmp_path / "corpus")

    def files(root: Path) -> dict[str, bytes]:
        return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}

    assert files(tmp_path / "corpus") == files(CORPUS)
