"""``benchmarks.bench_plan`` measures a real-size plan and ``benchmarks.plot_plan`` draws it (issue 17 §3).

Both rows (``scan_layers`` True and False) are planned for real on the sparse Llama-3.1-405B replica, in
this process's 8 simulated devices (the benchmark runs each row in a fresh process with 256; its
figures in docs/benchmarks.md are measured by hand, never asserted here); the parameter count is
checked against the published size and the bytes against the replica's index.
"""

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from benchmarks.bench_plan import plan_row

ROOT = Path(__file__).resolve().parents[2]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
# Llama-3.1-405B's parameters as published (model card: 405B; 405.85 B counted from its config.json).
LLAMA_405B_PARAMETERS = 405.9e9


def make_replica(name: str, out: Path) -> dict:
    spec = importlib.util.spec_from_file_location("make_replica", ROOT / "scripts" / "make_replica.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_replica"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module.make_replica(name, out)


@pytest.fixture(scope="module")
def llama_rows(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("replica") / "llama-3.1-405b"
    summary = make_replica("llama-3.1-405b", out)
    return [{"model": "llama-3.1-405b", "scan_layers": scan, "replica_bytes": summary["bytes"],
             **plan_row(out, scan, "fsdp=2,tp=4", 1, "tpu")} for scan in (True, False)]  # fmt: skip


@pytest.mark.parametrize("scan", [True, False])
def test_bench_plan_row_counts_the_real_model(llama_rows, scan):
    from benchmarks.plot_plan import ROW_KEYS

    r = llama_rows[0 if scan else 1]
    assert set(ROW_KEYS) <= set(r) and r["scan_layers"] is scan
    assert abs(r["parameters"] / LLAMA_405B_PARAMETERS - 1) < 0.01
    assert r["source_bytes"] == r["replica_bytes"]  # every tensor of the checkpoint is planned once
    # One process holds every device (the multi-process shares are tests/place/test_plan_scale.py's):
    # it needs, fetches and ideally holds each byte of the checkpoint once.
    assert r["needed"] == r["fetched"] == r["ideal"] == r["source_bytes"]
    assert 0 < r["plan_s"] < 120 and r["peak_rss"] > 0


def test_plot_writes_a_png_from_bench_plan_json(llama_rows, tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plot_plan import main

    results = {"devices": 8, "mesh": "fsdp=2,tp=4", "processes": 2, "platform": "tpu", "rows": llama_rows}
    (tmp_path / "plan.json").write_text(json.dumps(results))
    main([str(tmp_path / "plan.json"), "--out", str(tmp_path / "out" / "plan.png")])
    png = (tmp_path / "out" / "plan.png").read_bytes()
    assert png.startswith(PNG_MAGIC) and len(png) > 10_000


def test_plot_names_the_missing_figure(tmp_path):
    pytest.importorskip("matplotlib")
    from benchmarks.plot_plan import plot

    row = {"model": "m", "scan_layers": True, "parameters": 1e9, "source_bytes": 2e9, "plan_s": 1.0}
    with pytest.raises(ValueError, match="peak_rss"):
        plot({"rows": [row]}, tmp_path / "plan.png")
    assert not (tmp_path / "plan.png").exists()
