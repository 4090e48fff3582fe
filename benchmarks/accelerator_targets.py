"""Issue 30's figures and verdicts from one ``bench_load`` run: the machine's limits beside the loaders.

``bench_load --accelerator-targets`` prints this table after its usual ones (``benchmarks/gpu_run.sh``
passes it, on a GPU and in its ``PLATFORM=cpu`` dry run alike). A method the run did not measure
shows as "not measured"; the DMA limit shows "unavailable" (with the reason) where the platform
refused ``dma_map``. On CPU devices the verdicts are printed but mean nothing (the targets are an
accelerator's): the dry run checks that every row is produced.
"""

from __future__ import annotations

from benchmarks import harness

GIB = harness.GIB
# Warm targets (issue 30): GB/s into device memory, and the ratio to fastsafetensors, for a checkpoint
# of at least BIG_CHECKPOINT_GIB and for a smaller one (the 4 GiB of the table).
BIG_CHECKPOINT_GIB = 16
WARM_GBPS = {True: 12.0, False: 8.0}
WARM_OVER_FASTSAFETENSORS = {True: 5.0, False: 3.5}
# Cold: otfload's rate over the same run's O_DIRECT read of the files.
COLD_OVER_DIRECT = 0.9
# Host memory the process keeps after the load, beyond the ring (which the load frees anyway).
KEPT_GIB = 0.25
# The otfload variants and the limits, in the order they are shown.
LIMITS = ("floor-all", "direct", "dma-put", "pinned")
LOADERS = ("naive", "fastsafetensors", "otfload-staged", "otfload-hosthooks", "otfload", "otfload-primed")


def _gbps(r: dict) -> float:
    return r["checkpoint_bytes"] / r["seconds"] / 1e9


def _kept(r: dict) -> float:
    return (r["rss_after"] - r["rss_before"]) / GIB


def _first_leaf(r: dict) -> str:
    """From the call to the first leaf on its devices, planning included (the median run's)."""
    return f"{r['first_leaf_seconds']:.2f}" if "first_leaf_seconds" in r else ""


def figures_table(results: dict[str, dict]) -> str:
    """One row per limit and loader: GB/s, total and first-leaf seconds, peak and kept host memory."""
    rows: list[list[object]] = []
    for name in (*LIMITS, *LOADERS):
        r = results.get(name)
        if r is None:
            rows.append([name, "not measured", "", "", "", "", ""])
            continue
        note = r.get("dma") or r.get("host_route") or ("O_DIRECT" if r.get("o_direct") else "")
        if name == "direct" and not r.get("o_direct"):
            note = "buffered: the file system refused O_DIRECT"
        if name == "dma-put" and not str(note).startswith("direct DMA"):
            note = f"unavailable — {note}"
        rows.append([name, f"{_gbps(r):.2f}", f"{r['seconds']:.2f}", _first_leaf(r), f"{r['peak_rss'] / GIB:.2f}",
                     f"{_kept(r):.2f}", note])  # fmt: skip
    columns = ["route", "GB/s", "total s", "first leaf s", "peak RSS GiB", "RSS kept GiB", "note"]
    return harness.table(columns, rows)


def verdicts_table(results: dict[str, dict], cold: bool, ring_gib: float) -> str:
    """Each target of issue 30 that this run's methods can judge, with the measured figure."""
    rows: list[list[object]] = []

    def judge(label: str, value: float | None, goal: float, unit: str = "") -> None:
        if value is None:
            rows.append([label, "not measured", ""])
        else:
            rows.append([label, f"{value:.2f}{unit}", "PASS" if value >= goal else "MISS"])

    mine = results.get("otfload-primed") or results.get("otfload")
    fst = results.get("fastsafetensors")
    if cold:
        plain, floor = results.get("otfload"), results.get("direct")
        ratio = _gbps(plain) / _gbps(floor) if plain and floor else None
        judge(f"cold: otfload ≥ {COLD_OVER_DIRECT}× O_DIRECT read", ratio, COLD_OVER_DIRECT, "×")
        return harness.table(["target", "measured", "verdict"], rows)
    big = bool(mine) and mine["checkpoint_bytes"] >= BIG_CHECKPOINT_GIB * GIB
    size = f"≥ {BIG_CHECKPOINT_GIB} GiB" if big else f"< {BIG_CHECKPOINT_GIB} GiB"
    judge(f"warm, one transfer before: ≥ {WARM_GBPS[big]:g} GB/s ({size})", mine and _gbps(mine), WARM_GBPS[big])
    ratio = _gbps(mine) / _gbps(fst) if mine and fst else None
    judge(f"warm: ≥ {WARM_OVER_FASTSAFETENSORS[big]:g}× fastsafetensors", ratio, WARM_OVER_FASTSAFETENSORS[big], "×")
    if mine and fst:  # lower is better: judged as headroom left
        peak_room = (fst["peak_rss"] / GIB + ring_gib) - mine["peak_rss"] / GIB
        judge("peak host RSS ≤ fastsafetensors' + ring (GiB to spare)", peak_room, 0.0)
    else:
        judge("peak host RSS ≤ fastsafetensors' + ring (GiB to spare)", None, 0.0)
    kept_room = KEPT_GIB + ring_gib - _kept(mine) if mine else None
    judge(f"RSS kept ≤ {KEPT_GIB} GiB + ring (GiB to spare)", kept_room, 0.0)
    return harness.table(["target", "measured", "verdict"], rows)
