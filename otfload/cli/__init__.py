"""The ``otfload`` command line: ``inspect``, ``load``, ``export``, ``reshard``, ``bench``, ``eval``,
``generate``.

Exit codes: 0 success, 1 a typed :class:`~otfload.errors.OtfloadError` or a file-system ``OSError``
(its message is printed, without a traceback unless ``--debug``), 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from otfload.cli import bench, export, inspect, load, options, reshard
from otfload.cli import eval as eval_
from otfload.cli import generate as generate_

COMMANDS = (inspect, load, export, reshard, bench, eval_, generate_)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otfload", description="Load HF safetensors checkpoints into sharded JAX.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code."""
    args = build_parser().parse_args(argv)
    options.simulate_devices(getattr(args, "devices", None))
    from otfload.errors import OtfloadError

    run: Callable[[argparse.Namespace], int] = args.run  # each subcommand's ``run`` (``set_defaults``)
    try:
        return run(args)
    except BrokenPipeError:  # the reader of stdout stopped early (``otfload inspect ... | head``)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 0
    except (OtfloadError, OSError) as e:
        if args.debug:
            raise
        print(f"otfload: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
