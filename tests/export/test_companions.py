"""An export carries the source's tokenizer and generation files, byte for byte, so ``otfload eval``
runs on it; files that describe the source's weights (a quantization config) are not carried."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otfload.cli import main
from otfload.errors import CorruptFileError
from otfload.export.companions import COMPANION_FILES, read_companions
from otfload.sources import LocalSource
from tests.eval_support import TEXTS, with_tokenizer

WEIGHT_DESCRIPTIONS = ("hf_quant_config.json", "README.md")  # beside the weights, never copied


@pytest.fixture(scope="module")
def source(tiny_checkpoints, tmp_path_factory) -> Path:
    """The tiny llama with a tokenizer, its config files, and files an export must not copy."""
    path = with_tokenizer(tiny_checkpoints("llama")[0], tmp_path_factory.mktemp("llama-companions"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "model_max_length": 64}))
    (path / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<s>", "unk_token": "<unk>"}))
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "max_new_tokens": 7}))
    (path / "hf_quant_config.json").write_text(json.dumps({"quantization": {"quant_algo": "FP8"}}))
    (path / "README.md").write_text("not part of an export\n")
    return path


def test_export_copies_the_companions_and_eval_runs_on_it(source, tmp_path, capsys):
    out = tmp_path / "exported"
    assert main(["export", str(source), str(out)]) == 0
    carried = {p.name for p in out.iterdir()} & {*COMPANION_FILES, *WEIGHT_DESCRIPTIONS}
    assert carried == {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"}
    for name in carried:
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    data = tmp_path / "texts.txt"
    data.write_text("".join(t + "\n" for t in TEXTS))
    capsys.readouterr()
    results = []
    for checkpoint in (source, out):
        assert main(["eval", str(checkpoint), "--data", str(data), "--max-len", "16", "--no-progress", "--json"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert results[1]["tokens"] == results[0]["tokens"] > 0
    assert results[1]["nll"] == pytest.approx(results[0]["nll"], rel=1e-6)  # the export's weights are the source's


def test_an_oversized_companion_is_refused_naming_it(source, closing, monkeypatch):
    from otfload.export import companions

    monkeypatch.setattr(companions, "MAX_COMPANION_BYTES", (source / "tokenizer.json").stat().st_size - 1)
    with pytest.raises(CorruptFileError, match=r"tokenizer\.json: \d+ bytes, more than the \d+"):
        read_companions(closing(LocalSource(source)))
