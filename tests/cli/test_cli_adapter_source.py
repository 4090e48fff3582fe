"""A PEFT adapter's directory as the checkpoint of a subcommand (issue 44 point 6): the base its
``adapter_config.json`` names is loaded with it, and what is read beside the weights is the base's:
``load --verify``'s transformers + PEFT reference, ``eval``'s tokenizer, the tokenizer and generation
files ``export`` copies. ``export`` takes ``--adapter`` like every loading subcommand."""

from __future__ import annotations

import json

import numpy as np
from flax import nnx

import otfload
from otfload.cli import main


def test_load_verify_of_an_adapter_compares_with_peft_on_its_base(example_checkpoints, capsys):
    assert main(["load", str(example_checkpoints.adapter), "--verify"]) == 0
    out, err = capsys.readouterr()
    assert "verify: max relative difference vs transformers" in out and out.rstrip().endswith(": ok"), out
    assert "verify: loading the reference with transformers and PEFT" in err  # its longest step, announced
    assert "warning" not in err  # PEFT's FutureWarning about transformers' names is not the user's


def test_eval_of_an_adapter_reads_the_bases_tokenizer(example_checkpoints, tmp_path, capsys):
    data = tmp_path / "texts.jsonl"
    data.write_text(json.dumps({"text": "the quick brown fox jumps"}) + "\n")
    base, adapter = str(example_checkpoints.llama), str(example_checkpoints.adapter)
    results = []
    for argv in ([adapter], [base, "--adapter", adapter], [base]):
        assert main(["eval", *argv, "--data", str(data), "--json", "--no-progress", "--compile-cache", "off"]) == 0
        results.append(json.loads(capsys.readouterr().out))
    adapter, base_with_adapter, base = results
    assert adapter["nll"] == base_with_adapter["nll"] != base["nll"]  # the adapter applied, to the base named
    assert adapter["tokens"] == base["tokens"] > 0


def params(model) -> dict:
    return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def test_export_of_an_adapter_is_the_merged_model_with_the_bases_files(example_checkpoints, tmp_path, capsys):
    base, adapter = example_checkpoints.llama, example_checkpoints.adapter
    assert main(["export", str(adapter), str(tmp_path / "a")]) == 0
    assert main(["export", str(base), str(tmp_path / "b"), "--adapter", str(adapter)]) == 0
    assert f"exported {adapter} to" in capsys.readouterr().out
    merged = params(otfload.from_pretrained(base, adapter=str(adapter)))
    for out in (tmp_path / "a", tmp_path / "b"):
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
            assert (out / name).read_bytes() == (base / name).read_bytes(), (out, name)
        exported = params(otfload.from_pretrained(out))
        assert exported.keys() == merged.keys()
        assert all(np.array_equal(exported[k], merged[k]) for k in merged)
