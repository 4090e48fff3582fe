"""Options shared by the subcommands: the checkpoint source, the mesh, simulated devices, dtype; and
:func:`load_options`, the one place the load's flags become an :class:`~otfload.options.LoadOptions`."""

from __future__ import annotations

import argparse
import os
import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np
    from jax.sharding import Mesh

    from otfload.options import LoadOptions

_DEVICE_FLAG = re.compile(r"--xla_force_host_platform_device_count=\S+")
_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")  # a Sphinx cross-reference in a docstring
# The flags that are LoadOptions fields under the same name (``--scan-layers``: ``scan_layers``). Not
# ``load --verify`` (a check of the loaded model, not the shard cache's ``verify``), nor ``--mesh``.
LOAD_FLAGS = ("revision", "token", "dtype", "scan_layers", "adapter", "merge_adapter", "quantized", "reshard")


def description(doc: str) -> str:
    """A subcommand's ``--help`` text: its module docstring without the ``otfload NAME`` prefix, the
    literal quotes and the Sphinx roles (``:mod:`a.b``` reads ``a.b``, ``:class:`~a.B``` reads ``B``)."""
    text = _ROLE.sub(lambda m: m[2].rsplit(".", 1)[-1] if m[1] else m[2], doc.split(": ", 1)[1])
    return text.replace("``", "")


def common_parser() -> argparse.ArgumentParser:
    """Options every subcommand takes (a parent parser)."""
    parser = argparse.ArgumentParser(add_help=False)
    add_debug_arg(parser, default=argparse.SUPPRESS)  # unset here: the main parser's value stays
    return parser


def add_debug_arg(parser: argparse.ArgumentParser, default: object = False) -> None:
    """``--debug``, taken before the subcommand (the main parser's, ``default`` False) or after it."""
    parser.add_argument("--debug", action="store_true", default=default, help="show the traceback of errors")


def dtype_arg(text: str) -> np.dtype | None:
    """argparse type: a float dtype a load casts to (``bf16``, ``float32``, ...; ``auto``: the storage
    dtype), as :class:`~otfload.options.LoadOptions` checks it; other names are usage errors."""
    from otfload.errors import InvalidOptionError
    from otfload.options.checks import cast_dtype

    try:
        return cast_dtype("--dtype", text)
    except InvalidOptionError as e:
        raise argparse.ArgumentTypeError(str(e).split(": ", 1)[1]) from e


def mesh_arg(text: str) -> dict[str, int]:
    """argparse type: ``fsdp=4,tp=2`` as ``{"fsdp": 4, "tp": 2}``."""
    from otfload.errors import OtfloadError
    from otfload.plan.sharding import parse_mesh_spec

    try:
        return parse_mesh_spec(text)
    except OtfloadError as e:
        raise argparse.ArgumentTypeError(str(e)) from e


def size_arg(text: str) -> int:
    """argparse type: a size such as ``5GB`` or ``500MiB`` in bytes (checked before any work)."""
    from otfload.export.writer import parse_size

    try:
        size = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from e
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a size above 0 bytes, got {text!r}")
    return size


def positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def add_source_args(parser: argparse.ArgumentParser, metavar: str = "source") -> None:
    """The checkpoint location (``args.source``) and the Hub options that go with it."""
    parser.add_argument("source", metavar=metavar,
                        help="local directory, Hub repo id (org/name) or URL (gs://, s3://, hf://, ...); a PEFT "
                             "adapter's location loads the base its adapter_config.json names, with the adapter")
    parser.add_argument("--revision", help="Hub branch, tag or commit")
    parser.add_argument("--token", help="Hub token (default: the huggingface_hub login)")


def add_mesh_args(parser: argparse.ArgumentParser, *, mesh_help: str = "mesh axes, e.g. fsdp=4,tp=2") -> None:
    """The mesh of the target model and simulated devices."""
    parser.add_argument("--mesh", type=mesh_arg, help=f"{mesh_help} (default: every device on fsdp)")
    parser.add_argument("--devices", type=positive_int, metavar="N",
                        help="simulate N CPU devices (plan or load for a mesh this machine does not have)")


def add_layout_args(parser: argparse.ArgumentParser, *, mesh_help: str = "mesh axes, e.g. fsdp=4,tp=2") -> None:
    """Mesh, simulated devices (:func:`add_mesh_args`), dtype and layer layout of the target model."""
    add_mesh_args(parser, mesh_help=mesh_help)
    parser.add_argument("--dtype", type=dtype_arg, help="parameter dtype, e.g. bf16 (default: the storage dtype)")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                        help="stack layers on a leading axis for jax.lax.scan (default: yes)")


def add_adapter_args(parser: argparse.ArgumentParser) -> None:
    """PEFT LoRA adapters applied to the checkpoint, merged or kept."""
    parser.add_argument("--adapter", action="append", metavar="A",
                        help="PEFT LoRA adapter (local dir, Hub repo[@revision], URL); repeat for several, in order")
    parser.add_argument("--merge-adapter", action=argparse.BooleanOptionalAction, default=True,
                        help="merge the adapter into the base weights (default), or keep its LoRA factors as their "
                             "own parameters (--no-merge-adapter; one adapter)")


def add_load_args(parser: argparse.ArgumentParser) -> None:
    """The options of how a load reads, the same on every subcommand that loads (or plans) a model:
    adapters (:func:`add_adapter_args`), ``--quantized`` and ``--reshard``."""
    add_adapter_args(parser)
    parser.add_argument("--quantized", choices=("dequantize", "keep"), default="dequantize",
                        help="quantized weights decoded on load (default), or kept packed (codes + scales)")
    parser.add_argument("--reshard", choices=("auto", "always", "never"), default=None,
                        help="when a leaf is read as a band in the storage layout and resharded on the devices "
                             "(default: $OTFLOAD_RESHARD, else auto)")


def add_progress_arg(parser: argparse.ArgumentParser) -> None:
    """``--progress``/``--no-progress``: the load's bar in bytes and the command's own on stderr."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="progress bars on stderr (default: when stderr is a terminal)")


def simulate_devices(n: int | None) -> None:
    """Make JAX see ``n`` CPU devices; must run before JAX initialises its backend."""
    if n is None:
        return
    flags = _DEVICE_FLAG.sub("", os.environ.get("XLA_FLAGS", "")).strip()
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()
    import jax

    jax.config.update("jax_platforms", "cpu")  # type: ignore[no-untyped-call]  # jax's Config.update is unannotated


def mesh_of(args: argparse.Namespace) -> Mesh:
    """The ``Mesh`` of ``--mesh`` (every device on ``fsdp`` when not given)."""
    from otfload.plan.sharding import make_mesh

    return make_mesh(args.mesh)


def load_options(args: argparse.Namespace, *, mesh: bool = True) -> LoadOptions:
    """The :class:`~otfload.options.LoadOptions` of a subcommand's flags (:data:`LOAD_FLAGS`, and
    ``--mesh`` made a ``Mesh`` unless ``mesh`` is False: a command that resolves it otherwise); a flag
    the subcommand lacks or left unset keeps the option's default."""
    from otfload.options import LoadOptions

    given = {name: getattr(args, name) for name in LOAD_FLAGS if getattr(args, name, None) is not None}
    if mesh and hasattr(args, "mesh"):
        given["mesh"] = mesh_of(args)
    return LoadOptions(**given)


def adapter_as_checkpoint(args: argparse.Namespace) -> None:
    """A PEFT adapter given as the checkpoint (a location with ``adapter_config.json`` and no
    ``config.json``): ``args.source`` becomes the base its config names (at the adapter's
    ``revision``) and the adapter the first of ``args.adapter``, so that what a subcommand reads
    beside the weights (``--verify``'s reference, the tokenizer, the files ``export`` copies) is the
    base's. Any other source is left as it is."""
    from otfload.adapters.load import base_location, base_not_found, named_base
    from otfload.errors import SourceNotFoundError
    from otfload.sources import open_source
    from otfload.sources.owned import owned_source

    given = load_options(args, mesh=False).source_options()
    with owned_source(args.source, **given) as source:
        adapter = named_base(source)
    if adapter is None:
        return
    base, base_options = base_location(adapter, given)
    try:
        open_source(base, **base_options).close()  # the library's message for a base that is not there
    except SourceNotFoundError as e:
        raise base_not_found(adapter, e) from None
    spec = args.source if args.revision is None else f"{args.source}@{args.revision}"  # the adapter's revision
    args.source, args.revision = base, base_options.get("revision")
    args.adapter = [spec, *(args.adapter or [])]
