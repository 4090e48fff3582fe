"""The ``otfload`` command line: ``inspect``, ``load``, ``export``, ``reshard``, ``bench``, ``eval``,
``generate``, ``lm-eval``, ``example``.

Exit codes: 0 success, 1 a typed ``OtfloadError`` or a file-system ``OSError`` (its message is
printed, with the CLI's flags for the Python arguments it names, without a traceback unless
``--debug``), 2 bad usage: a flag argparse refuses (the subcommand's usage is shown), or an
``InvalidOptionError`` such as a mesh needing another number of devices, 130 interrupted (Ctrl-C:
one line, and no output directory half written).
"""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
import warnings
from collections.abc import Callable, Sequence

from otfload.cli import bench, example, export, harness, inspect, load, options, reshard
from otfload.cli import eval as eval_
from otfload.cli import generate as generate_

COMMANDS = (inspect, load, export, reshard, bench, eval_, generate_, harness, example)
INTERRUPTED = 130  # the shell's exit status of a process ended by SIGINT (128 + 2)


class VersionAction(argparse.Action):
    """``--version``: the installed package's version, looked up only when asked (importlib.metadata
    costs ~0.1 s of every start otherwise)."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, help="show the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, *_: object) -> None:
        from importlib.metadata import version

        print(f"otfload {version('otfload')}")  # on stdout, as argparse's own version action
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="otfload", description="Load HF safetensors checkpoints into sharded JAX.")
    parser.add_argument("--version", action=VersionAction)
    options.add_debug_arg(parser)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(commands)
    for sub in commands.choices.values():
        sub.set_defaults(command_parser=sub)  # a flag the subcommand does not know is reported with its usage
    return parser


def refuse_unknown(args: argparse.Namespace, unknown: list[str]) -> None:
    """Exit 2 with the subcommand's usage for arguments it does not take, offering a close flag
    (``load --verfy``: did you mean --verify?)."""
    sub: argparse.ArgumentParser = args.command_parser
    known = [flag for action in sub._actions for flag in action.option_strings]  # argparse lists them nowhere public
    hints = [f"{arg} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(arg.split("=")[0], known, 1))
             else arg for arg in unknown]
    sub.error(f"unrecognized arguments: {' '.join(hints)}")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit code. ``argv`` None: the process's own arguments (the
    console script), whose work is done when this returns: Ctrl-C is then ignored while the
    interpreter shuts JAX down (it would print the traceback of a ``KeyboardInterrupt`` raised in
    JAX's teardown callbacks), and the exit code stays the command's."""
    try:
        args, unknown = build_parser().parse_known_args(argv)
    except KeyboardInterrupt:  # while the flags are parsed: a size flag's parser imports numpy (~1 s loaded)
        if "--debug" in (sys.argv[1:] if argv is None else argv):
            raise
        print("otfload: interrupted", file=sys.stderr)
        return INTERRUPTED
    code = _run(args, unknown)
    if argv is None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    return code


def _run(args: argparse.Namespace, unknown: list[str]) -> int:
    """The parsed command run: its exit code, errors and Ctrl-C each one line (see the module docstring)."""
    from otfload.cli.messages import cli_message, show_warning
    from otfload.errors import InvalidOptionError, OtfloadError

    run: Callable[[argparse.Namespace], int] = args.run  # each subcommand's ``run`` (``set_defaults``)
    try:
        if unknown:
            refuse_unknown(args, unknown)
        options.simulate_devices(getattr(args, "devices", None))
        with warnings.catch_warnings():  # restores Python's own display when the command returns
            warnings.showwarning = show_warning
            return run(args)
    except BrokenPipeError:  # the reader of stdout stopped early (``otfload inspect ... | head``)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing left to flush at exit
        return 0
    except (OtfloadError, OSError) as e:
        if args.debug:
            raise
        print(f"otfload: error: {type(e).__name__}: {cli_message(e)}", file=sys.stderr)
        return 2 if isinstance(e, InvalidOptionError) else 1
    except KeyboardInterrupt:  # Ctrl-C: what was being written is not there (outputs are written whole)
        if args.debug:
            raise
        print(f"otfload: {args.command}: interrupted", file=sys.stderr)
        return INTERRUPTED
