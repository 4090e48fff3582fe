"""``otfload reshard``: re-save a native checkpoint in the layout of a target mesh.

--json prints one object instead of the line: {"source", "destination", "step", "mesh"}.
"""

from __future__ import annotations

import argparse
import json
import os

from otfload.cli import options


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("reshard", help="re-save a native checkpoint for a target mesh",
                            description=options.description(__doc__), parents=[options.common_parser()])
    p.add_argument("src", help="native (Orbax) checkpoint directory")
    p.add_argument("dst", help="output checkpoint directory")
    p.add_argument("--mesh", type=options.mesh_arg, required=True, help="target mesh axes, e.g. fsdp=16,tp=2")
    p.add_argument("--devices", type=options.positive_int, metavar="N",
                   help="simulate N CPU devices (the mesh must use all devices)")
    p.add_argument("--step", type=int, help="step to reshard (default: the latest)")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="layer layout expected in SRC (default: from its metadata)")
    p.add_argument("--json", action="store_true", help="print what was written as one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from otfload.checkpoint import reshard_checkpoint

    made = not os.path.lexists(args.dst)
    try:
        step = reshard_checkpoint(args.src, args.dst, args.mesh, step=args.step, scan_layers=args.scan_layers)
    except BaseException:
        if made and os.path.isdir(args.dst) and not os.listdir(args.dst):
            os.rmdir(args.dst)  # a failed reshard leaves no empty DST behind
        raise
    if args.json:
        print(json.dumps({"source": args.src, "destination": args.dst, "step": step, "mesh": args.mesh}))
        return 0
    axes = ", ".join(f"{k}={v}" for k, v in args.mesh.items())
    print(f"resharded step {step} of {args.src} into {args.dst} for mesh {axes}")
    return 0
