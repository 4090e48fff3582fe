"""``otfload eval`` and ``otfload generate``: the installed console script in a fresh process
forked from tests.forked's server (JSON and progress bar as a user sees them) and in-process
``main`` calls; numbers checked against
transformers' loss and greedy ``generate`` on a tiny checkpoint with a real ``tokenizer.json``."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest

from otfload.cli import main
from tests import forked
from tests.cli.test_cli import OTFLOAD
from tests.eval_support import TEXTS, as_arrays, reference_nll, rel, with_tokenizer
from tests.models.kinds import torch_greedy

MAX_LEN = 16


@pytest.fixture(scope="module")
def llama_tok(tiny_checkpoints, tmp_path_factory) -> tuple[Path, object]:
    path, torch_model = tiny_checkpoints("llama")
    return with_tokenizer(path, tmp_path_factory.mktemp("llama-tok")), torch_model


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, Path]:
    """TEXTS as a JSONL file and as a text file (one text per line)."""
    root = tmp_path_factory.mktemp("data")
    (root / "texts.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (root / "texts.txt").write_text("".join(t + "\n" for t in TEXTS))
    return {"jsonl": root / "texts.jsonl", "text": root / "texts.txt"}


def test_eval_json_matches_transformers_with_a_progress_bar_on_stderr(llama_tok, data):
    path, torch_model = llama_tok
    env = {k: v for k, v in os.environ.items() if k != "TQDM_DISABLE"}
    out = forked.run(
        [str(OTFLOAD), "eval", str(path), "--data", str(data["jsonl"]), "--devices", "8", "--mesh", "fsdp=2,tp=4",
         "--max-len", str(MAX_LEN), "--batch-size", "3", "--json", "--progress"],
        timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)  # stdout holds the JSON object only
    nll, count = as_arrays(reference_nll(torch_model, path / "tokenizer.json", TEXTS, MAX_LEN))
    assert result["tokens"] == int(count.sum())
    assert rel(result["nll"], float(nll.sum())) <= 1e-4
    assert math.isclose(result["perplexity"], math.exp(result["nll"] / result["tokens"]), rel_tol=1e-12)
    assert (result["texts"], result["skipped"], result["truncated"]) == (len(TEXTS), 2, 2)
    assert result["load_seconds"] > 0 and result["tokens_per_second"] > 0
    assert "eval: 100%" in out.stderr and "tok" in out.stderr  # the tqdm bar, on stderr


def test_eval_text_file_and_human_output(llama_tok, data, capsys):
    path, _ = llama_tok
    args = ["eval", str(path), "--max-len", str(MAX_LEN), "--batch-size", "4", "--no-progress"]
    assert main([*args, "--data", str(data["jsonl"]), "--json"]) == 0
    as_json = json.loads(capsys.readouterr().out)
    assert main([*args, "--data", str(data["text"])]) == 0  # one text per line: the same texts
    text = capsys.readouterr().out
    assert f"nll: {as_json['nll']:.6f} nats over {as_json['tokens']} predicted tokens" in text
    assert "2 empty or one-token, skipped; 2 truncated to 16 tokens" in text
    assert "load: " in text and "tokens/s" in text


def test_eval_errors_exit_1_naming_the_file(tiny_checkpoints, llama_tok, data, tmp_path, capsys):
    bare, _ = tiny_checkpoints("llama")
    assert main(["eval", str(bare), "--data", str(data["jsonl"])]) == 1
    assert "TokenizerNotFoundError: tokenizer.json not found in" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"txt": "oops"}\n')
    assert main(["eval", str(llama_tok[0]), "--data", str(bad)]) == 1
    assert "EvalDataError: " in (err := capsys.readouterr().err) and "bad.jsonl:2: field 'text'" in err
    assert main(["eval", str(llama_tok[0]), "--data", str(tmp_path / "absent.jsonl")]) == 1
    assert f"EvalDataError: data file '{tmp_path / 'absent.jsonl'}' does not exist" in capsys.readouterr().err
    assert main(["eval", str(llama_tok[0]), "--data", str(tmp_path)]) == 1
    assert "EvalDataError: " in (err := capsys.readouterr().err) and "is a directory" in err
    with pytest.raises(SystemExit) as usage:
        main(["eval", str(llama_tok[0]), "--data", str(bad), "--batch-size", "0"])
    assert usage.value.code == 2


def assert_generate_matches(path: Path, torch_model, capsys, prompts: list[str], new: int, greedy=torch_greedy,
                            flags: tuple[str, ...] = ()):
    """``otfload generate --json`` of ``prompts`` (and ``flags``): each row's ids and text equal
    ``greedy(torch_model, ids, mask, new)`` (transformers' ids of the prompts left-padded to one batch,
    cut at EOS), and its prompt ids equal transformers' tokenizer's."""
    from transformers import PreTrainedTokenizerFast

    assert main(["generate", str(path), *(a for p in prompts for a in ("--prompt", p)), "--max-new-tokens", str(new),
                 "--json", *flags]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    reference = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    encoded = [reference(p)["input_ids"] for p in prompts]
    width = max(map(len, encoded))
    ids = np.array([[0] * (width - len(e)) + e for e in encoded])
    mask = np.array([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    expected = greedy(torch_model, ids, mask, new)[:, width:]
    eos = torch_model.generation_config.eos_token_id
    for row, prompt, prompt_ids, want in zip(rows, prompts, encoded, expected, strict=True):
        want = want.tolist()
        want = want[: want.index(eos)] if eos in want else want
        assert row["prompt"] == prompt and row["prompt_ids"] == prompt_ids and row["new_ids"] == want
        assert row["completion"] == reference.decode(want, skip_special_tokens=True)


def test_generate_matches_transformers_greedy(llama_tok, capsys):
    from transformers import PreTrainedTokenizerFast

    path, torch_model = llama_tok
    prompts = ["the quick brown fox", "a checkpoint"]
    assert_generate_matches(path, torch_model, capsys, prompts, 6)
    assert main(["generate", str(path), "--prompt", prompts[0], "--max-new-tokens", "2"]) == 0
    printed = capsys.readouterr().out.splitlines()
    reference = PreTrainedTokenizerFast(tokenizer_file=str(path / "tokenizer.json"))
    assert printed[0].startswith(reference.decode(reference(prompts[0])["input_ids"], skip_special_tokens=True))
    assert printed[1].startswith("(loaded in ")
