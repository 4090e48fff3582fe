"""``otfload lm-eval`` and ``python -m otfload.lm_eval run --model otfload``: the installed commands
in fresh processes, as a user runs them (forked from tests.forked's server; the console script as a
plain subprocess is tests/cli/test_cli_messages.py's). The JSON holds lm_eval's ``results`` equal to
its ``hf`` backend's; a second job loads its scoring and decoding programs from the persistent cache
(no tracing or lowering, no new entry) and gives the same results."""

from __future__ import annotations

import json
import math
import os
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


def lm_eval_job(checkpoint, tasks, cache) -> dict:
    """``otfload lm-eval ... --json`` in a fresh (forked) process."""
    out = forked.run(
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
    first = lm_eval_job(checkpoint, tasks, cache)
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


def test_lm_eval_own_command_line_runs_the_otfload_model_and_keeps_its_programs(setup, tmp_path):
    """lm_eval's command line builds the backend from ``model_args``: compiled programs are kept in
    ``$OTFLOAD_COMPILE_CACHE`` by default (as ``otfload lm-eval`` keeps them)."""
    checkpoint, tasks = setup
    cache = tmp_path / "default"
    out = forked.run(
        [sys.executable, "-m", "otfload.lm_eval", "run", "--model", "otfload",
         "--model_args", f"pretrained={checkpoint},mesh=fsdp:4/tp:2", "--batch_size", "8",
         "--tasks", "otf_mc", "--include_path", str(tasks), "--limit", str(LIMIT)],
        timeout=600, env={**os.environ, "OTFLOAD_COMPILE_CACHE": str(cache)})
    assert out.returncode == 0, out.stderr
    row = next(line for line in out.stdout.splitlines() if "otf_mc" in line)  # lm_eval's results table
    assert "acc" in row
    assert [p.name.split("-")[0] for p in (cache / DIR_NAME).iterdir()] == ["_loglik_of_batch"]


def test_compile_cache_off_in_model_args_keeps_nothing(setup, tmp_path, monkeypatch):
    """``compile_cache=off`` in ``model_args``: the backend lm_eval's registry builds from the string
    (what its command line calls, as in the job above) makes no ``$OTFLOAD_COMPILE_CACHE`` and leaves
    JAX's cache setting alone. Built in this process: the setting is decided at construction."""
    import jax
    from lm_eval.api.registry import get_model

    import otfload.lm_eval  # noqa: F401  (registers the "otfload" model, as python -m otfload.lm_eval does)

    checkpoint, _ = setup
    off = tmp_path / "unused"
    monkeypatch.setenv("OTFLOAD_COMPILE_CACHE", str(off))
    before = jax.config.jax_compilation_cache_dir
    model = get_model("otfload").create_from_arg_string(
        f"pretrained={checkpoint},mesh=fsdp:4/tp:2,compile_cache=off", {"batch_size": 8, "device": None})
    model.close()
    assert not off.exists() and jax.config.jax_compilation_cache_dir == before


def test_unknown_task_fails_before_the_load(setup):
    checkpoint, tasks = setup
    out = forked.run([str(OTFLOAD), "lm-eval", str(checkpoint), "--tasks", "no_such_task", "--include-path",
                      str(tasks), "--compile-cache", "off", "--json"], timeout=300)
    assert out.returncode != 0 and "no lm_eval task or group named 'no_such_task'" in out.stderr
