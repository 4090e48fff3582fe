"""``otfload example``: write the example checkpoints the docs pages use into DIR: a tiny Llama
(tiny-llama: tokenizer, chat template), a PEFT LoRA adapter of it (tiny-lora) and an FP8 copy
(tiny-fp8), from numpy alone (otfload.examples). Prints the export lines that point the pages'
OTFLOAD_EXAMPLE_CKPT, OTFLOAD_EXAMPLE_ADAPTER and OTFLOAD_EXAMPLE_QUANTIZED at them:
eval "$(otfload example DIR)".
"""

from __future__ import annotations

import argparse

from otfload.cli import options
from otfload.examples import add_arguments


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("example", help="write the docs' example checkpoints (tiny Llama, LoRA, FP8)",
                            description=options.description(__doc__), parents=[options.common_parser()])
    add_arguments(p)
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from otfload.examples import write_examples

    print(write_examples(args.directory, overwrite=args.overwrite).exports())
    return 0
