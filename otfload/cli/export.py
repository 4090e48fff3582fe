"""``otfload export``: write a checkpoint back as Hugging Face safetensors.

SRC is an HF checkpoint (loaded with from_pretrained and written back through the inverted mapping
table, see otfload.export.export_checkpoint) or a native (Orbax) checkpoint directory (exported
leaf by leaf with its recorded family, config and scan_layers, see otfload.export.export_native).
The output can be cast (``--dtype``) and re-split into files of at most ``--max-shard-size``.
Progress bars on stderr (the load's, then the bytes written) follow --progress/--no-progress.
--json prints one object instead of the line: {"source", "out", "files" (the names written)}.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

from otfload.cli import options


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("export", help="write a checkpoint back as HF safetensors",
                            description=options.description(__doc__), parents=[options.common_parser()])
    options.add_source_args(p, "SRC")
    p.add_argument("out", help="output directory")
    options.add_mesh_args(p, mesh_help="mesh to load an HF SRC on, e.g. fsdp=4,tp=2")
    options.add_load_args(p)
    options.add_progress_arg(p)
    p.add_argument("--step", type=int, help="step of a native SRC (default: the latest)")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                   help="layer layout: of a native SRC, checked against its metadata (default: as saved); "
                        "of the model an HF SRC is loaded into (default: scanned)")
    p.add_argument("--dtype", type=options.dtype_arg, help="dtype written, e.g. bf16 (default: keep)")
    p.add_argument("--max-shard-size", type=options.size_arg, default="5GB", help="largest output file (default: 5GB)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--json", action="store_true", help="print what was written as one JSON object")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from otfload.errors import InvalidOptionError, OutputExistsError
    from otfload.export import export_checkpoint, export_native, is_native_checkpoint

    if os.path.lexists(args.out) and not args.overwrite:  # before anything is loaded
        raise OutputExistsError(f"{args.out} exists; pass --overwrite to replace it")
    if args.quantized != "dequantize" or not args.merge_adapter:  # an HF checkpoint holds plain weights
        raise InvalidOptionError("export writes each weight whole (quantized ones dequantized, adapters merged): "
                                 "--quantized keep and --no-merge-adapter do not apply")
    given = args.source
    options.adapter_as_checkpoint(args)
    written = dict(dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite)
    if is_native_checkpoint(args.source):
        if args.adapter:
            raise InvalidOptionError("--adapter: a native SRC is exported as it was saved (merge adapters when "
                                     "loading the HF checkpoint it came from)")
        out = export_native(args.source, args.out, step=args.step, scan_layers=args.scan_layers,
                            progress=args.progress, **written)
    else:  # the load's flags (--dtype, the one written, is the load's too: a cast either way)
        load = dataclasses.replace(options.load_options(args), progress=args.progress)
        out = export_checkpoint(args.source, args.out, options=load, **written)
    if args.json:
        print(json.dumps({"source": given, "out": str(out), "files": sorted(p.name for p in out.iterdir())}))
        return 0
    print(f"exported {given} to {out}")
    return 0
