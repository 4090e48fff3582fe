"""``benchmarks.bench_eval_job`` (issue 31's GPU job, dry-run on the CPU at a tiny size) runs its
three jobs end to end: otfload's first and repeated ``otfload eval`` and transformers' reference
predict the same tokens with the same NLL, and the repeated job finds its programs kept (the timings
themselves are measured on an accelerator for docs/benchmarks.md, never asserted)."""

from __future__ import annotations

import json
import math
import sys

import pytest

from tests import forked

pytest.importorskip("transformers")


def test_three_jobs_score_the_same_tokens(tmp_path):
    figures = tmp_path / "figures.json"
    out = forked.run([sys.executable, "-m", "benchmarks.bench_eval_job", "--platform", "cpu", "--preset", "tiny",
                      "--texts", "4", "--max-len", "64", "--out", str(tmp_path / "data"), "--json", str(figures)],
                     timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(figures.read_text())
    jobs = result["jobs"]
    assert set(jobs) == {"otfload, first job", "otfload, repeated job", "transformers"}
    assert len({job["tokens"] for job in jobs.values()}) == 1 and jobs["transformers"]["tokens"] == 4 * 63
    for name in ("otfload, first job", "otfload, repeated job"):  # bf16 both ways: sums agree to ~1e-3
        assert math.isclose(jobs[name]["nll_per_token"], jobs["transformers"]["nll_per_token"], rel_tol=1e-3)
    assert jobs["otfload, first job"]["lower_seconds"] > 0 and jobs["otfload, repeated job"]["lower_seconds"] == 0
    assert len(result["targets"]) == 3
