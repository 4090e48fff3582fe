"""``benchmarks.bench_eval`` still runs end to end, and its projection's parameter and KV-cache
counts agree with the published sizes of the models it names (the timings themselves are measured
by hand for docs/evaluation.md, never asserted)."""

import os
import sys
from pathlib import Path

import pytest

from benchmarks.bench_eval import ARCHS
from tests import forked

ROOT = Path(__file__).resolve().parents[2]

# (total, active incl. the input embedding) parameters as the model cards publish them
PUBLISHED = {"Llama-3.1-8B": (8.03e9, 8.03e9), "Llama-3.1-70B": (70.6e9, 70.6e9),
             "Mixtral-8x7B": (46.7e9, 12.9e9), "Qwen3-30B-A3B": (30.5e9, 3.3e9)}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_projected_parameter_counts_are_the_published_ones(name):
    arch = next(a for a in ARCHS if a.name == name)
    total, active = arch.counts()
    embedding = arch.vocab * arch.hidden  # the counts' active figure leaves the lookup out
    assert abs(total / PUBLISHED[name][0] - 1) < 0.01
    assert abs((active + embedding) / PUBLISHED[name][1] - 1) < 0.02


def test_kv_bytes_per_token():
    kv = {a.name: a.kv_per_token() for a in ARCHS}
    assert kv["Llama-3.1-8B"] == 2 * 32 * 8 * 128 * 2 == 128 * 1024
    assert kv["DeepSeek-V3"] == 61 * (512 + 64) * 2


def test_measure_and_project_run(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-m", "benchmarks.bench_eval"]
    out = forked.run([*run, "--preset", "tiny", "--texts", "3", "--len", "24", "--batch-size", "2"], cwd=tmp_path,
                     env=env, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "| tiny | 13 M | bfloat16 | 3 × 24 | 2 |" in out.stdout and "69 predicted tokens" in out.stdout
    out = forked.run([*run, "--project"], cwd=tmp_path, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.count("| 8×H100 |") == len(ARCHS)
