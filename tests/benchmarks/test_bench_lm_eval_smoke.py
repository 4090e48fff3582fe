"""``benchmarks.bench_lm_eval`` runs end to end on tiny shapes: its task file is one lm_eval loads,
and the overlap child reports the timings it compares (the figures themselves are measured by hand
for docs/benchmarks.md, never asserted by a timed test)."""

from __future__ import annotations

import json
import sys

import pytest

from tests import forked

pytest.importorskip("lm_eval")

from benchmarks.bench_lm_eval import OVERLAP_CHILD, make_task  # noqa: E402
from tests.eval_support import with_tokenizer  # noqa: E402
from tests.lmeval.tasks import tokenizer_config  # noqa: E402


def test_task_file_is_a_multiple_choice_task_lm_eval_loads(tmp_path):
    from lm_eval.tasks import TaskManager, get_task_dict

    root = make_task(tmp_path / "tasks", questions=3)
    task = get_task_dict(["bench_mc"], TaskManager(include_path=str(root), include_defaults=False))["bench_mc"]
    docs = list(task.test_docs())
    assert len(docs) == 3 and all(len(d["choices"]) == 4 and 0 <= d["answer"] < 4 for d in docs)
    assert task.OUTPUT_TYPE == "multiple_choice"


@pytest.mark.parametrize("mode", ["sequential", "overlapped"])
def test_overlap_child_reports_load_compile_and_ready(tiny_checkpoints, tmp_path, mode):
    path, _ = tiny_checkpoints("llama")
    checkpoint = with_tokenizer(path, tmp_path / "ckpt")
    tokenizer_config(checkpoint)
    out = forked.run([sys.executable, "-c", OVERLAP_CHILD, mode, "16,32", str(checkpoint), "8"], timeout=300)
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["load_seconds"] > 0 and result["compile_seconds"] > 0
    assert result["ready"] >= max(result["load_seconds"], result["compile_seconds"])
