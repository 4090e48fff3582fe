"""``otfload bench``: time loads of a checkpoint and print the read throughput of each."""

from __future__ import annotations

import argparse
import gc
import statistics

from otfload.cli import options


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("bench", help="time loads of a checkpoint (GB/s)", description=options.description(__doc__),
                            parents=[options.common_parser()])
    options.add_source_args(p)
    options.add_layout_args(p)
    options.add_load_args(p)
    p.add_argument("--repeats", type=options.positive_int, default=3, help="number of loads (default: 3)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from otfload.api import from_pretrained
    from otfload.sources.owned import owned_source

    options.adapter_as_checkpoint(args)
    load_options = options.load_options(args)
    speeds: list[float] = []
    with owned_source(args.source, **load_options.source_options()) as source:  # closed on return or error
        for i in range(args.repeats):  # at least one (``positive_int``)
            model, report = from_pretrained(source, options=load_options, return_report=True, progress=False)
            del model
            gc.collect()
            speeds.append(report.gbps)
            print(f"run {i + 1}: {report.bytes_read / 1e9:.3f} GB in {report.seconds:.3f} s = {report.gbps:.2f} GB/s")
    print(f"best {max(speeds):.2f} GB/s, median {statistics.median(speeds):.2f} GB/s over {args.repeats} load(s)")
    print(report.summary())
    return 0
