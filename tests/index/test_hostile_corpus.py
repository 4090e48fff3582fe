"""The committed corpus of hostile files: each raises its expected typed error, and the script rebuilds it exactly."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from otfload import errors
from otfload.index.header import read_header
from otfload.sources import LocalSource
from tests.index.support import RecordingSource

CORPUS = Path(__file__).parent / "hostile_corpus"
SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_hostile_corpus.py"
EXPECTED: dict[str, dict] = json.loads((CORPUS / "expected.json").read_text())


@pytest.fixture(scope="module")
def source() -> RecordingSource:
    return RecordingSource(LocalSource(CORPUS))


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


def test_every_corpus_file_has_an_expectation():
    assert {p.name for p in CORPUS.iterdir()} == set(EXPECTED) | {"expected.json"}
    assert sum(p.stat().st_size for p in CORPUS.iterdir()) < 200_000


def test_script_regenerates_the_corpus_byte_for_byte(tmp_path: Path):
    spec = importlib.util.spec_from_file_location("make_hostile_corpus", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.write_corpus(tmp_path / "corpus")
    regenerated = {p.name: p.read_bytes() for p in (tmp_path / "corpus").iterdir()}
    assert regenerated == {p.name: p.read_bytes() for p in CORPUS.iterdir()}
