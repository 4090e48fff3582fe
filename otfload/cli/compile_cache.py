"""``--compile-cache DIR|off``: the persistent compilation cache of command-line jobs
(:mod:`otfload.compile_cache`; on by default)."""

from __future__ import annotations

import argparse


def add_compile_cache_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--compile-cache", metavar="DIR|off", default=None,
                        help="keep compiled programs in DIR for later jobs (default: $OTFLOAD_COMPILE_CACHE, else "
                             "~/.cache/otfload/xla); off: compile afresh")
