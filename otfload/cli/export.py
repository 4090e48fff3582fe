"""``otfload export``: write a checkpoint back as Hugging Face safetensors.

SRC is an HF checkpoint (loaded with from_pretrained and written back through the inverted mapping
table, see otfload.export.export_checkpoint) or a native (Orbax) checkpoint directory (exported
leaf by leaf with its recorded family, config and scan_layers, see otfload.export.export_native).
The output can be cast (``--dtype``) and re-split into files of at most ``--max-shard-size``.
"""

from __future__ import annotations

import argparse
import os

from otfload.cli import options


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("export", help="write a checkpoint back as HF safetensors",
                            description=options.description(__doc__), parents=[options.common_parser()])
    options.add_source_args(p, "src")
    p.add_argument("out", help="output directory")
    p.add_argument("--mesh", type=options.mesh_arg, help="mesh to load an HF SRC on (default: every device on fsdp)")
    p.add_argument("--devices", type=options.positive_int, metavar="N", help="simulate N CPU devices")
    p.add_argument("--step", type=int, help="step of a native SRC (default: the latest)")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="layer layout: of a native SRC, checked against its metadata (default: as saved); "
                        "of the model an HF SRC is loaded into (default: scanned)")
    p.add_argument("--dtype", type=options.dtype_arg, help="dtype written, e.g. bf16 (default: keep)")
    p.add_argument("--max-shard-size", type=options.size_arg, default="5GB", help="largest output file (default: 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from otfload.errors import OutputExistsError
    from otfload.export import export_checkpoint, export_native, is_native_checkpoint

    if os.path.lexists(args.out) and not args.overwrite:  # before anything is loaded
        raise OutputExistsError(f"{args.out} exists; pass --overwrite to replace it")
    written = dict(dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    if is_native_checkpoint(args.src):
        out = export_native(args.src, args.out, step=args.step, scan_layers=args.scan_layers, **written)
    else:
        scan = True if args.scan_layers is None else args.scan_layers
        load_options = options.load_options(args)  # the source's options and the mesh (--dtype is the written one)
        out = export_checkpoint(args.src, args.out, mesh=load_options.mesh, scan_layers=scan, **written,
                                **load_options.source_options())  # fmt: skip
    print(f"exported {args.src} to {out}")
    return 0
