"""``otfload export``: load a checkpoint and write it back as Hugging Face safetensors.

The model goes through the loader and back through the inverted mapping table
(:func:`otfload.export.export_checkpoint`): optionally cast (``--dtype``) and re-split into files of
at most ``--max-shard-size``.
"""

from __future__ import annotations

import argparse

from otfload.cli import options


def add_parser(commands: argparse._SubParsersAction) -> None:
    p = commands.add_parser("export", help="write a checkpoint back as HF safetensors",
                            description=options.description(__doc__), parents=[options.common_parser()])
    options.add_source_args(p, "src")
    p.add_argument("out", help="output directory")
    p.add_argument("--mesh", type=options.mesh_arg, help="mesh to load on (default: every device on fsdp)")
    p.add_argument("--devices", type=options.positive_int, metavar="N", help="simulate N CPU devices")
    p.add_argument("--dtype", type=options.dtype_arg, help="dtype written, e.g. bf16 (default: keep)")
    p.add_argument("--max-shard-size", default="5GB", help="largest output file (default: 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from otfload.export import export_checkpoint

    out = export_checkpoint(args.src, args.out, mesh=options.mesh_of(args), dtype=args.dtype,
                            max_shard_size=args.max_shard_size, overwrite=args.overwrite,
                            **options.source_options(args))
    print(f"exported {args.src} to {out}")
    return 0
