"""The files beside the weights that make an export usable as its source was: the tokenizer and the
generation settings, copied byte for byte from the reference checkpoint.

Only the files named in :data:`COMPANION_FILES` are copied, and only those the reference lists (a
remote source lists its JSON files; a local directory every file). Files that describe the weights
are never copied: export writes its own ``config.json`` and index, and a quantization config
(``hf_quant_config.json``, ...) would describe weights the export no longer holds (it writes them
dequantised). Each file is read whole, so a size bound keeps a hostile listing from filling memory.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from otfload.errors import CorruptFileError
from otfload.sources import Source, read_bytes
from otfload.tokenizer import MAX_TOKENIZER_BYTES

# What ``transformers``' tokenizers and ``GenerationConfig`` read beside a checkpoint, and what
# ``otfload eval`` / ``generate`` read (tokenizer.json).
COMPANION_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
    "generation_config.json",
)
# The largest companion read: a tokenizer.json is the largest of them (published ones up to 35 MB).
MAX_COMPANION_BYTES = MAX_TOKENIZER_BYTES


def read_companions(source: Source) -> dict[str, bytes]:
    """The companion files ``source`` holds: name → bytes (``CorruptFileError`` for one past the bound)."""
    listed = set(source.list_files())
    out = {}
    for name in COMPANION_FILES:
        if name not in listed:
            continue
        size = source.size(name)
        if size > MAX_COMPANION_BYTES:
            raise CorruptFileError(f"{source.description}/{name}",
                                   f"{size} bytes, more than the {MAX_COMPANION_BYTES} a tokenizer or generation "
                                   "file may have")
        out[name] = read_bytes(source, name)
    return out


def write_companions(out: Path, files: Mapping[str, bytes]) -> None:
    """Write the companion files read by :func:`read_companions` into the export directory ``out``."""
    for name, data in files.items():
        (out / name).write_bytes(data)


__all__ = ["COMPANION_FILES", "MAX_COMPANION_BYTES", "read_companions", "write_companions"]
