"""An lm_eval job over two real ``jax.distributed`` processes on 127.0.0.1 (2 CPU devices each).

On a mesh of its own devices each process is one of lm_eval's ranks: it answers only its share of
the requests; process 0 alone gets the results. On a mesh spanning both, the two drive one replica
and each runs every request. Either way the results equal a one-process job's (every sample's
responses, within 1e-4 for loglikelihoods; the metrics). ``otfload lm-eval`` run as two processes
(``--coordinator/--num-processes/--process-id``) prints its JSON from process 0 only, the same.
Every process is a fresh one forked from tests.forked's server (the imports done once).
"""

from __future__ import annotations

import json
import math
import sys

import pytest

pytest.importorskip("lm_eval")

from tests import forked  # noqa: E402
from tests.cli.test_cli import OTFLOAD  # noqa: E402
from tests.eval_support import with_tokenizer  # noqa: E402
from tests.lmeval.tasks import TASKS, tokenizer_config, write_tasks  # noqa: E402
from tests.lmeval.test_parity import REL, evaluate  # noqa: E402
from tests.multihost.launch import REPO_ROOT, wait_workers, worker_env  # noqa: E402
from tests.servers.net import free_port  # noqa: E402

PROCESSES, LOCAL_DEVICES, BATCH = 2, 2, 4


@pytest.fixture(scope="module")
def setup(tiny_checkpoints, tmp_path_factory):
    path, _ = tiny_checkpoints("llama")
    checkpoint = with_tokenizer(path, tmp_path_factory.mktemp("llama-lm-eval-mh"))
    tokenizer_config(checkpoint)
    return checkpoint, write_tasks(tmp_path_factory.mktemp("tasks"), questions=9)  # odd: ranks' shares differ


@pytest.fixture(scope="module")
def one_process(setup):
    import jax

    from otfload.lm_eval import OtfloadLM
    from otfload.plan.sharding import make_mesh

    checkpoint, tasks = setup
    mesh = make_mesh({"fsdp": LOCAL_DEVICES}, jax.devices()[:LOCAL_DEVICES])  # as one worker's
    return evaluate(OtfloadLM(str(checkpoint), mesh=mesh, batch_size=BATCH), tasks, TASKS)


def by_doc(samples) -> dict:
    return {task: {str(s["doc_id"]): s["resps"] for s in rows} for task, rows in samples.items()}


def assert_same_results(mine: dict, ref: dict) -> None:
    assert set(mine) == set(ref)
    for task, metrics in ref.items():
        assert set(mine[task]) == set(metrics)
        for key, value in metrics.items():
            if isinstance(value, float) and not math.isnan(value):
                assert math.isclose(mine[task][key], value, rel_tol=REL), (task, key, mine[task][key], value)
            elif not isinstance(value, float):
                assert mine[task][key] == value, (task, key)


def assert_same_responses(mine: dict, ref: dict) -> None:
    assert {t: sorted(d) for t, d in mine.items()} == {t: sorted(d) for t, d in ref.items()}  # every document once
    for task, docs in ref.items():
        for doc, resps in docs.items():
            for x, y in zip(mine[task][doc], resps, strict=True):
                if isinstance(y[0], str):
                    assert x == y, (task, doc)
                elif isinstance(y[0], tuple | list):
                    assert math.isclose(x[0][0], y[0][0], rel_tol=REL) and x[0][1] == y[0][1], (task, doc)
                else:
                    assert math.isclose(x[0], y[0], rel_tol=REL), (task, doc)


def run_processes(commands, timeout_s=600.0) -> list[str]:
    procs = [forked.Process(cmd, cwd=REPO_ROOT, env=worker_env()) for cmd in commands]
    try:
        outs = [p.communicate(timeout=timeout_s) for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode == 0 for p in procs), "\n----\n".join(err[-4000:] for _, err in outs)
    return [out for out, _ in outs]


MESHES = {"mesh-per-process": "fsdp:2", "mesh-over-both": "fsdp:2/tp:2"}


@pytest.fixture(scope="module")
def jobs(setup, tmp_path_factory) -> dict[str, list[dict]]:
    """Both meshes' evaluations in one two-process job (one start-up): every process's report, by mesh."""
    checkpoint, tasks = setup
    out = tmp_path_factory.mktemp("lm-eval-mh")
    spec = {"processes": PROCESSES, "local_devices": LOCAL_DEVICES, "port": free_port(), "checkpoint": str(checkpoint),
            "meshes": list(MESHES.values()), "task_dir": str(tasks), "tasks": list(TASKS), "batch_size": BATCH,
            "out": str(out)}
    (out / "spec.json").write_text(json.dumps(spec))
    procs = [forked.Process([sys.executable, "-m", "tests.lmeval.distributed_worker", str(out / "spec.json"), str(i)],
                            cwd=REPO_ROOT, env=worker_env(), merge=True) for i in range(PROCESSES)]
    wait_workers(procs, timeout_s=600)
    reports = [json.loads((out / f"proc{i}.json").read_text()) for i in range(PROCESSES)]
    return {name: [r[k] for r in reports] for k, name in enumerate(MESHES)}


@pytest.mark.parametrize(("mesh", "replicas"), [("mesh-per-process", True), ("mesh-over-both", False)],
                         ids=list(MESHES))
def test_two_processes_get_one_process_numbers(jobs, one_process, mesh, replicas):
    """A mesh of each process's 2 devices: each is a rank answering its share, only process 0 gets
    the results. A mesh of all 4 devices (its sizes multiply to the job's count): one replica both
    processes drive, every request run by both, each batch sharded over the two processes."""
    reports = jobs[mesh]
    total = sum(len(s) * len(s[0]["resps"]) for s in one_process["samples"].values())  # requests of one process
    if replicas:
        assert [(r["rank"], r["world_size"]) for r in reports] == [(0, 2), (1, 2)]
        assert reports[1]["out"] is None  # only process 0 gets (and so writes) the results
        for r in reports:  # a share each: about half (lm_eval pads the smaller share to the larger one)
            assert 0 < r["answered"] <= total // 2 + len(TASKS) * 4
    else:
        assert [(r["rank"], r["world_size"]) for r in reports] == [(0, 1), (0, 1)]
        assert [r["answered"] for r in reports] == [total, total]
        assert reports[1]["out"] == reports[0]["out"]
    mine = reports[0]["out"]
    assert_same_responses(mine["samples"], by_doc(one_process["samples"]))
    assert_same_results(mine["results"], one_process["results"])


def test_cli_job_over_two_processes_prints_from_process_0_only(setup, one_process):
    """One task (multiple choice): every request type over two ranks is the ``jobs`` fixture's; this
    is the command line's joining and printing."""
    checkpoint, tasks = setup
    port, task = free_port(), TASKS[0]
    commands = [[str(OTFLOAD), "lm-eval", str(checkpoint), "--tasks", task, "--include-path", str(tasks),
                 "--devices", str(LOCAL_DEVICES), "--mesh", f"fsdp={LOCAL_DEVICES}", "--batch-size", str(BATCH),
                 "--compile-cache", "off", "--no-progress", "--json", "--coordinator", f"127.0.0.1:{port}",
                 "--num-processes", str(PROCESSES), "--process-id", str(i)] for i in range(PROCESSES)]
    first, second = run_processes(commands)
    assert second == ""
    assert_same_results(json.loads(first)["results"], {task: one_process["results"][task]})




def test_lm_eval_command_line_joins_the_job_by_model_args(setup, one_process, tmp_path):
    """lm_eval's own command line (``python -m otfload.lm_eval run``) as two processes: the job is
    joined by ``model_args`` (coordinator, num_processes, process_id); process 0 writes the results,
    equal to a one-process job's."""
    checkpoint, tasks = setup
    port, task = free_port(), TASKS[0]
    env = {**worker_env(), "XLA_FLAGS": f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"}
    commands = [[sys.executable, "-m", "otfload.lm_eval", "run", "--model", "otfload", "--model_args",
                 f"pretrained={checkpoint},mesh=fsdp:{LOCAL_DEVICES},coordinator=127.0.0.1:{port},"
                 f"num_processes={PROCESSES},process_id={i}", "--batch_size", str(BATCH), "--tasks", task,
                 "--include_path", str(tasks),
                 "--output_path", str(tmp_path / f"out{i}")] for i in range(PROCESSES)]
    procs = [forked.Process(cmd, cwd=REPO_ROOT, env=env, merge=True) for cmd in commands]
    outputs = wait_workers(procs, timeout_s=600)
    written = [sorted((tmp_path / f"out{i}").rglob("results_*.json")) for i in range(PROCESSES)]
    assert len(written[0]) == 1 and not written[1], outputs  # process 0 alone writes the results
    results = json.loads(written[0][0].read_text())["results"]
    assert_same_results({task: results[task]}, {task: one_process["results"][task]})


def test_a_process_that_fails_ends_the_job_on_every_process(setup):
    """``--limit 1`` over two processes: lm_eval gives process 1 no document and raises there before
    its first exchange; process 0, waiting for it, ends within seconds with an error naming process
    1 and its reason, not after the hour-long collective bound."""
    checkpoint, tasks = setup
    port = free_port()
    commands = [[str(OTFLOAD), "lm-eval", str(checkpoint), "--tasks", ",".join(TASKS), "--include-path", str(tasks),
                 "--devices", str(LOCAL_DEVICES), "--mesh", f"fsdp={LOCAL_DEVICES}", "--batch-size", str(BATCH),
                 "--compile-cache", "off", "--no-progress", "--limit", "1", "--coordinator", f"127.0.0.1:{port}",
                 "--num-processes", str(PROCESSES), "--process-id", str(i)] for i in range(PROCESSES)]
    procs = [forked.Process(cmd, cwd=REPO_ROOT, env=worker_env()) for cmd in commands]
    try:
        errors = [p.communicate(timeout=300)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert all(p.returncode != 0 for p in procs)
    assert "did not find any docs" in errors[1], errors[1][-3000:]
    assert "process 1 left the job" in errors[0] and "did not find any docs" in errors[0], errors[0][-3000:]
