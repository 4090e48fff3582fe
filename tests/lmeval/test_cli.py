"""``otfload lm-eval`` and ``python -m otfload.lm_eval run --model otfload``: the installed commands
in fresh processes, as a user runs them (the first job a plain subprocess, the others forked from
tests.forked's server). The JSON holds lm_eval's ``results`` equal to its ``hf`` backend's; a
second job loads its scoring and decoding programs from the persistent cache (no tracing or
lowering, no new entry) and gives the same results."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

pytest.importorskip("lm_eval")

from otfload.programs import DIR_NAME  # noqa: E402
from tests import forked  # noqa: E402
from tests.cli.test_cli import OTFLOAD  # noqa: E402
from tests.eval_support import with_tokenizer  # noqa: E402
from tests.lmeval.tasks import tokenizer_config, write_tasks  # noqa: E402

LIMIT = 6  # documents per task: a short job


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    path, _ = tiny_checkpoints("llama")
    checkpoint = with_tokenizer(path, tmp_path_factory.mktemp("llama-lm-eval-cli"))
    tokenizer_config(checkpoint)
    return checkpoint, write_tasks(tmp_path_factory.mktemp("tasks"))


def lm_eval_job(checkpoint, tasks, cache, run=forked.run) -> dict:
    """``otfload lm-eval ... --json`` run by ``run`` (a forked child; ``subprocess.run``: a plain one)."""
    out = run(
        [str(OTFLOAD), "lm-eval", str(checkpoint), "--tasks", "otf_mc,otf_ppl,otf_gen", "--include-path", str(tasks),
         "--limit", str(LIMIT), "--devices", "8", "--mesh", "fsdp=2,tp=4", "--batch-size", "8",
         "--compile-cache", str(cache), "--json"],
        capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)  # stdout holds the JSON object only


def test_lm_eval_json_equals_hf_backend_and_second_job_compiles_nothing_new(setup, tmp_path):
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    checkpoint, tasks = setup
    cache = tmp_path / "xla"
    first = lm_eval_job(checkpoint, tasks, cache, subprocess.run)  # the command exactly as a user starts it
    entries = sorted(p.name for p in cache.iterdir())
    assert any("loglik_of_batch" in name for name in entries)  # the scoring step was cached
    programs = {p.name: p.stat().st_mtime_ns for p in (cache / DIR_NAME).iterdir()}
    assert {name.split("-")[0] for name in programs} == {"_loglik_of_batch", "_decoding_step"}
    second = lm_eval_job(checkpoint, tasks, cache)
    assert sorted(p.name for p in cache.iterdir()) == entries  # nothing compiled: no new XLA entry
    assert {p.name: p.stat().st_mtime_ns for p in (cache / DIR_NAME).iterdir()} == programs  # none rewritten
    assert second["timings"]["lower_seconds"] == 0.0  # every program loaded: nothing traced or lowered
    assert second["timings"]["compile_seconds"] < first["timings"]["compile_seconds"] / 4
    assert second["results"] == first["results"]  # otf_gen's exact match: of the same generations
    timings = first["timings"]
    assert set(timings) == {"load_seconds", "compile_seconds", "lower_seconds", "score_seconds", "generate_seconds"}
    assert 0 < timings["lower_seconds"] < timings["compile_seconds"]

    local = TaskManager(include_path=str(tasks), include_defaults=False)  # not lm_eval's ~14k built-in task files
    ref = lm_eval.simple_evaluate(
        model=HFLM(pretrained=str(checkpoint), batch_size=8, device="cpu", dtype="float32"),
        tasks=["otf_mc", "otf_ppl"], limit=LIMIT, task_manager=local)
    for task, metrics in ref["results"].items():
        for key, value in metrics.items():
            if isinstance(value, float):
                assert math.isclose(first["results"][task][key], value, rel_tol=1e-4), (task, key)
            else:
                assert first["results"][task][key] == value, (task, key)


def lm_eval_cli_job(checkpoint, tasks, model_args: str, cache_env) -> str:
    """``python -m otfload.lm_eval run --model otfload`` (lm_eval's own command line); its stdout."""
    out = forked.run(
        [sys.executable, "-m", "otfload.lm_eval", "run", "--model", "otfload",
         "--model_args", f"pretrained={checkpoint},mesh=fsdp:4/tp:2{model_args}", "--batch_size", "8",
         "--tasks", "otf_mc", "--include_path", str(tasks), "--limit", str(LIMIT)],
        timeout=600, env={**os.environ, "OTFLOAD_COMPILE_CACHE": str(cache_env)})
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_lm_eval_own_command_line_runs_the_otfload_model_and_keeps_its_programs(setup, tmp_path):
    """lm_eval's command line builds the backend from ``model_args``: compiled programs are kept in
    ``$OTFLOAD_COMPILE_CACHE`` by default (as ``otfload lm-eval`` keeps them), not with
    ``compile_cache=off``."""
    checkpoint, tasks = setup
    default, off = tmp_path / "default", tmp_path / "unused"
    stdout = lm_eval_cli_job(checkpoint, tasks, "", default)
    row = next(line for line in stdout.splitlines() if "otf_mc" in line)  # lm_eval's results table
    assert "acc" in row
    assert [p.name.split("-")[0] for p in (default / DIR_NAME).iterdir()] == ["_loglik_of_batch"]
    lm_eval_cli_job(checkpoint, tasks, ",compile_cache=off", off)
    assert not off.exists()


def test_unknown_task_fails_before_the_load(setup):
    checkpoint, tasks = setup
    out = forked.run([str(OTFLOAD), "lm-eval", str(checkpoint), "--tasks", "no_such_task", "--include-path",
                      str(tasks), "--compile-cache", "off", "--json"], timeout=300)
    assert out.returncode != 0 and "no lm_eval task or group named 'no_such_task'" in out.stderr
