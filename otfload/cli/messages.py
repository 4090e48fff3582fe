"""An error's message as a command-line user reads it: the flags to type, not the Python arguments.

The library's messages name keyword arguments (``pass overwrite=True``), the API's vocabulary. The
command line prints the same message with each keyword the CLI sets by a flag replaced by that
flag (``pass --overwrite``), and says how to fix a mesh that needs another number of devices with
the ``--devices`` and ``--mesh`` flags. Warnings read the same way (``otfload: warning: ...``). A
keyword inside a quoted Python call (``from_pretrained(..., merge_adapter=False)``) is left as it is.
"""

from __future__ import annotations

import re
import sys
from typing import TextIO

from otfload.errors import DeviceCountError

# Keyword spellings in library messages → the flag that sets them (each subcommand that takes the
# keyword takes the flag). Longest first, so that ``merge_adapter=`` is not read as ``adapter=``.
FLAGS: tuple[tuple[str, str], ...] = (
    ("merge_adapter=False", "--no-merge-adapter"),
    ("merge_adapter=True", "--merge-adapter"),
    ("scan_layers=False", "--no-scan-layers"),
    ("scan_layers=True", "--scan-layers"),
    ("overwrite=True", "--overwrite"),
    ("adapter=", "--adapter"),
    ("mesh=", "--mesh"),
)
# A keyword standing alone: not part of a longer name, not an argument inside a call's parentheses.
_KEYWORD = re.compile(
    r"(?<![\w.(])(?<!, )(" + "|".join(re.escape(keyword) for keyword, _ in FLAGS) + r")(?![\w'\"])"
)
_FLAG_OF = dict(FLAGS)


def cli_message(error: Exception) -> str:
    """The text ``otfload`` prints for ``error`` (after ``otfload: error: <type>: ``)."""
    if isinstance(error, DeviceCountError):
        return (f"mesh {error.sizes} needs {error.needed} devices, but {error.available} are available: pass "
                f"--mesh with sizes whose product is {error.available}, or --devices {error.needed} to simulate "
                f"{error.needed} CPU devices (or set XLA_FLAGS=--xla_force_host_platform_device_count="
                f"{error.needed})")
    return _KEYWORD.sub(lambda m: _FLAG_OF[m[1]], str(error))


def show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                 file: TextIO | None = None, line: str | None = None) -> None:
    """``warnings.showwarning`` for the command line: ``otfload: warning: <type>: <message>`` on
    stderr, in the CLI's words, without the source line Python shows."""
    text = cli_message(message) if isinstance(message, Exception) else message
    print(f"otfload: warning: {category.__name__}: {text}", file=sys.stderr if file is None else file)


__all__ = ["FLAGS", "cli_message", "show_warning"]
