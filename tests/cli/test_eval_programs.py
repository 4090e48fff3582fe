"""Programs kept across jobs (``otfload.programs``), as a user meets them: ``otfload eval`` jobs in
fresh processes sharing one ``--compile-cache`` (forked from tests.forked's server, its imports done
once; the console script as a plain subprocess is tests/cli/test_cli_messages.py's). The second job
loads every scoring program (no tracing, lowering or compilation: nothing new written,
``lower_seconds`` 0) and gives the first job's numbers; a corrupt entry and a stale one (a valid
entry of another shape under this shape's name) are compiled afresh, with a warning, give the same
numbers and are rewritten for the next job; a changed input (the batch size) is a new entry, not
the old program."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from otfload.programs import DIR_NAME
from tests import forked
from tests.cli.test_cli import OTFLOAD
from tests.eval_support import TEXTS, with_tokenizer

MAX_LEN = 64  # long enough for the texts to need two batch widths


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints, tmp_path_factory) -> Path:
    path, _ = tiny_checkpoints("llama")
    return with_tokenizer(path, tmp_path_factory.mktemp("llama-programs"))


def eval_job(checkpoint: Path, data: Path, cache: Path, batch_size: int = 3) -> tuple[dict, str]:
    out = forked.run(
        [str(OTFLOAD), "eval", str(checkpoint), "--data", str(data), "--devices", "8", "--mesh", "fsdp=2,tp=4",
         "--max-len", str(MAX_LEN), "--batch-size", str(batch_size), "--compile-cache", str(cache), "--json",
         "--no-progress"],
        capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout), out.stderr


def entries(cache: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted((cache / DIR_NAME).iterdir())}


def test_second_job_loads_its_programs_and_bad_entries_are_compiled_afresh(checkpoint, tmp_path):
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    cache = tmp_path / "xla"

    first, _ = eval_job(checkpoint, data, cache)
    kept = entries(cache)
    assert len(kept) == 2 and all(name.startswith("_nll_of_batch-") for name in kept)  # two batch widths
    assert first["lower_seconds"] > 0

    second, _ = eval_job(checkpoint, data, cache)
    assert second["lower_seconds"] == 0.0  # nothing traced or lowered
    assert entries(cache) == kept  # every program came from the cache, none written again
    assert (second["nll"], second["tokens"]) == (first["nll"], first["tokens"])
    assert second["compile_seconds"] < first["compile_seconds"]

    corrupt, stale = kept  # one entry with a byte flipped, the other holding the first's (valid) program
    flipped = bytearray(kept[corrupt])
    flipped[len(flipped) // 2] ^= 0xFF
    (cache / DIR_NAME / corrupt).write_bytes(bytes(flipped))
    (cache / DIR_NAME / stale).write_bytes(kept[corrupt])
    third, stderr = eval_job(checkpoint, data, cache)
    assert "fails its checksum; compiling afresh" in stderr
    assert "takes other arguments than this call's; compiling afresh" in stderr
    assert third["lower_seconds"] > 0
    assert (third["nll"], third["tokens"]) == (first["nll"], first["tokens"])
    rewritten = entries(cache)
    assert rewritten.keys() == kept.keys()
    assert rewritten[corrupt] != bytes(flipped) and rewritten[stale] != kept[corrupt]
    fourth, _ = eval_job(checkpoint, data, cache)  # the rewritten entries serve the next job
    assert fourth["lower_seconds"] == 0.0 and (fourth["nll"], fourth["tokens"]) == (first["nll"], first["tokens"])

    other, _ = eval_job(checkpoint, data, cache, batch_size=4)
    assert other["lower_seconds"] > 0 and len(entries(cache)) == 4  # other shapes: new programs, new entries
