"""The generation benchmarks run end to end on tiny shapes: ``benchmarks.bench_lm_eval``'s
``bench_gen`` task is a ``generate_until`` task lm_eval loads, and ``benchmarks.bench_decode_step``'s
child reports a step's wall and CPU seconds (the figures themselves are measured by hand for
docs/benchmarks.md, never asserted by a timed test)."""

from __future__ import annotations

import json
import sys

import pytest

from tests import forked

pytest.importorskip("lm_eval")

from benchmarks.bench_decode_step import CHILD  # noqa: E402
from benchmarks.bench_lm_eval import make_gen_task  # noqa: E402


def test_gen_task_file_is_a_generate_until_task_lm_eval_loads(tmp_path):
    from lm_eval.tasks import TaskManager

    name = make_gen_task(tmp_path, prompts=3)
    task = TaskManager(include_path=str(tmp_path), include_defaults=False).load([name])["tasks"][name]
    docs = list(task.test_docs())
    assert len(docs) == 3 and all(d["prompt"] for d in docs)
    assert task.OUTPUT_TYPE == "generate_until"
    assert task.config.generation_kwargs["until"] == ["\n", "."]


def test_decode_step_child_reports_wall_and_cpu_per_step(tiny_checkpoints):
    path, _ = tiny_checkpoints("llama")
    # 8 steps, median of 3 pairs: one step (~7 ms of CPU) is within a busy machine's noise, and a single
    # pair's difference can come out <= 0 (its wall did, at load average 12)
    out = forked.run([sys.executable, "-c", CHILD, str(path), "8", "8", "3"], timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == {"read", "free"}
    assert all(len(r) == 3 and r[1] > 0 for r in result.values())  # wall, CPU, the wall's minimum
