"""``otfload bench``: time loads of a checkpoint and print the read throughput of each.

--json prints one object instead: {"source", "runs" (each load's bytes_read, seconds, gbps), "best_gbps",
"median_gbps", "report" (the last load's report, as load --json prints it)}.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics

from otfload.cli import options


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("bench", help="time loads of a checkpoint (GB/s)", description=options.description(__doc__),
                            parents=[options.common_parser()])
    options.add_source_args(p)
    options.add_layout_args(p)
    options.add_load_args(p)
    p.add_argument("--repeats", type=options.positive_int, default=3, help="number of loads (default: 3)")
    p.add_argument("--json", action="store_true", help="print the runs and the last report as one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from otfload.api import from_pretrained
    from otfload.cli.load import report_json
    from otfload.sources.owned import owned_source

    options.adapter_as_checkpoint(args)
    load_options = options.load_options(args)
    runs: list[dict[str, float]] = []
    with owned_source(args.source, **load_options.source_options()) as source:  # closed on return or error
        for i in range(args.repeats):  # at least one (``positive_int``)
            model, report = from_pretrained(source, options=load_options, return_report=True, progress=False)
            del model
            gc.collect()
            runs.append({"bytes_read": report.bytes_read, "seconds": report.seconds, "gbps": report.gbps})
            if not args.json:
                print(f"run {i + 1}: {report.bytes_read / 1e9:.3f} GB in {report.seconds:.3f} s = "
                      f"{report.gbps:.2f} GB/s")
    speeds = [r["gbps"] for r in runs]
    best, median = max(speeds), statistics.median(speeds)
    if args.json:
        print(json.dumps({"source": args.source, "runs": runs, "best_gbps": best, "median_gbps": median,
                          "report": report_json(report)}))
        return 0
    print(f"best {best:.2f} GB/s, median {median:.2f} GB/s over {args.repeats} load(s)")
    print(report.summary())
    return 0
