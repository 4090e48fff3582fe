"""Plot of plans at real size (issue 17 §3): plan time, peak RSS and bytes per process against model size.

    python -m benchmarks.bench_plan --replicas /tmp/replicas --json /tmp/plan.json --plot docs/plan_scale.png
    python -m benchmarks.plot_plan /tmp/plan.json --out docs/plan_scale.png   # again, from the saved results

Reads the results ``bench_plan --json`` writes (one row per model and ``scan_layers`` value) and draws,
against the parameters each plan places (log scale, one point per model):

* plan time for ``scan_layers`` True and False (wall, and CPU seconds where recorded), with the
  issue's 10 s target;
* peak RSS of the planning process, with the 1 GiB target;
* the bytes process 0 needs (its devices' boxes), fetches (both ``scan_layers`` values; reading bands
  and resharding on the devices can fetch less than the ideal) and the ideal (the source bytes of the
  elements its devices hold, each distinct shard once).

matplotlib is in the ``bench`` extra (``pip install -e .[bench]``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

GIB = 2**30
MIB = 2**20
# The targets issue 17 §3 sets for planning the largest model (DeepSeek-V3 671B) on 256 devices.
PLAN_TARGET_S = 10.0
RSS_TARGET_MIB = 1024.0
# Keys each result row must carry for the plot (bench_plan's child writes them).
ROW_KEYS = ("model", "scan_layers", "parameters", "source_bytes", "plan_s", "peak_rss", "needed", "fetched", "ideal")


def _series(rows: list[dict], scan: bool) -> list[dict]:
    """The rows of one ``scan_layers`` value, smallest model first."""
    return sorted((r for r in rows if r["scan_layers"] is scan), key=lambda r: r["parameters"])


def plot(results: dict, path: Path) -> Path:
    """Draw ``results`` (``bench_plan --json``'s dict) into ``path`` (PNG); returns ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results["rows"]
    for row in rows:
        missing = [k for k in ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"result row {row.get('model')!r} lacks {missing}")
    scanned, unscanned = _series(rows, True), _series(rows, False)
    models = scanned or unscanned
    xs = [r["parameters"] / 1e9 for r in models]
    ticks = [f"{r['model']}\n{x:.0f} B, {r['source_bytes'] / 1e9:.0f} GB" + (
        f"\n{r['tensors']:,} tensors" if r.get("tensors") else "") for r, x in zip(models, xs, strict=True)]
    fig, (time_ax, rss_ax, bytes_ax) = plt.subplots(1, 3, figsize=(16, 4.6))
    for ax, key, scale, label, target in (
        (time_ax, "plan_s", 1.0, f"plan time (s; fastest of {results.get('repeat', 1)} runs)", PLAN_TARGET_S),
        (rss_ax, "peak_rss", MIB, "peak RSS of planning (MiB)", RSS_TARGET_MIB),
    ):
        for series, style, color in ((scanned, "o-", "C0"), (unscanned, "s--", "C1")):
            if series:
                ax.plot([r["parameters"] / 1e9 for r in series], [r[key] / scale for r in series], style,
                        color=color, label=f"scan_layers={series[0]['scan_layers']}")  # fmt: skip
        ax.axhline(target, color="grey", linestyle=":", label=f"target ≤ {target:g}")
        if key == "plan_s":  # CPU seconds of all threads, where recorded: what other jobs disturb least
            for series, style, color in ((scanned, "o:", "C0"), (unscanned, "s:", "C1")):
                if series and all("plan_cpu_s" in r for r in series):
                    ax.plot([r["parameters"] / 1e9 for r in series], [r["plan_cpu_s"] for r in series], style,
                            color=color, alpha=0.4, label=f"scan_layers={series[0]['scan_layers']}, CPU s")  # fmt: skip
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
    base = scanned or unscanned  # needed and ideal bytes do not depend on scan_layers
    for key, style, name in (("needed", "^-", "needs (its devices' boxes)"),
                             ("ideal", "kx:", "ideal (source bytes its devices hold)")):
        bytes_ax.plot(xs, [r[key] / GIB for r in base], style, label=name)
    for series, style in ((scanned, "o-"), (unscanned, "s--")):
        if series:
            bytes_ax.plot([r["parameters"] / 1e9 for r in series], [r["fetched"] / GIB for r in series], style,
                          label=f"fetches, scan_layers={series[0]['scan_layers']}", alpha=0.8)  # fmt: skip
    bytes_ax.set_ylabel(f"bytes of process 0 of {results.get('processes', '?')} (GiB)")
    bytes_ax.set_ylim(bottom=0)
    for ax in (time_ax, rss_ax, bytes_ax):
        ax.set_xscale("log")
        ax.set_xticks(xs, ticks, fontsize=7)
        ax.minorticks_off()
        ax.set_xlabel("parameters placed (billions, log scale); checkpoint bytes; tensors")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Plans at real size on sparse replicas: {results.get('devices', '?')} devices "
                 f"({results.get('mesh', '?')}), read layouts for --platform {results.get('platform', '?')}; "
                 f"{results.get('machine', '')}"
                 + (f"; after: {results['machine_after']}" if "machine_after" in results else ""),
                 fontsize=9)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("results", type=Path, help="the JSON bench_plan --json wrote")
    parser.add_argument("--out", type=Path, default=Path("docs/plan_scale.png"))
    args = parser.parse_args(argv)
    print(plot(json.loads(args.results.read_text()), args.out))


if __name__ == "__main__":
    main()
