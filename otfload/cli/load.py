"""``otfload load``: load a checkpoint, print the load report, and optionally check the model.

``--verify`` runs a forward pass on fixed token ids and checks the logits are finite; when
transformers is installed and the checkpoint is a local directory it also loads the checkpoint
with ``AutoModelForCausalLM`` in float32 and compares like with like: a model loaded in bf16 or
fp16 runs in float32 from its weights as loaded, against transformers' weights rounded to the same
dtype (adapters merged first), so the max relative difference (``max |ours - theirs| / max |theirs|``)
must be at most 1e-3 whatever the dtype; the line printed says what was compared. With
``--adapter`` (local directories) the reference is PEFT's ``PeftModel`` on that model.
``--adapter A`` (repeatable) applies PEFT LoRA adapters in order, merged into the weights, or kept
as separate factors with ``--no-merge-adapter``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import TYPE_CHECKING

from otfload.cli import options

if TYPE_CHECKING:
    from otfload.place.report import LoadReport
    from otfload.sources import Source


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("load", help="load a checkpoint and print the load report",
                            description=options.description(__doc__), parents=[options.common_parser()])
    options.add_source_args(p)
    options.add_layout_args(p)
    options.add_load_args(p)
    p.add_argument("--json", action="store_true", help="print the load report as one JSON object")
    p.add_argument("--verify", action="store_true",
                   help="run a forward pass and compare its logits with transformers' (a check of the model; "
                        "unrelated to from_pretrained's verify=, the shard cache's integrity check)")
    p.set_defaults(run=run)


def report_json(report: LoadReport) -> dict[str, object]:
    """The load report as JSON: its fields (activation scales as lists of floats)."""
    import numpy as np

    fields = dataclasses.asdict(report)
    fields["activation_scales"] = {k: np.asarray(v, np.float64).ravel().tolist()
                                   for k, v in report.activation_scales.items()}
    return fields


def config_vocab_size(source: Source) -> int:
    """``vocab_size`` of the checkpoint's config.json."""
    from otfload.errors import CheckpointIndexError
    from otfload.index.checkpoint import CONFIG_FILE, read_json

    config = read_json(source, CONFIG_FILE)
    if not isinstance(config, dict):  # the load has checked it already
        raise CheckpointIndexError(f"{CONFIG_FILE}: not a JSON object")
    return int(config["vocab_size"])


def run(args: argparse.Namespace) -> int:
    from otfload.api import from_pretrained
    from otfload.cli.verify import verify
    from otfload.sources.owned import owned_source

    options.adapter_as_checkpoint(args)
    load_options = options.load_options(args)
    with owned_source(args.source, **load_options.source_options()) as source:  # closed on return or error
        model, report = from_pretrained(source, options=load_options, return_report=True)
        print(json.dumps(report_json(report)) if args.json else report.summary())
        if not args.merge_adapter:
            from otfload.adapters.factored import factored_record

            print(f"adapter kept: LoRA factors on {len(factored_record(model).leaves)} leaves")
        if args.verify and not verify(model, args.source, config_vocab_size(source), args.adapter):
            print("otfload: verification failed", file=sys.stderr)
            return 1
    return 0
