"""What a checkpoint location string names, decided on the local file system before any network.

A string may be a URL, a local path or a Hub repo id, and a mistyped local path must not be sent
to the Hub (where it fails only after the retry bounds, ~12 s offline, with a DNS error that says
nothing about the path). The rules, in order:

1. ``scheme://...`` is a URL.
2. An existing directory is a local checkpoint.
3. An existing file (``tinyqwen/model.safetensors``) is an error naming its folder: a checkpoint is
   the directory holding ``config.json`` and the ``*.safetensors`` files.
4. A string the Hub could accept as a repo id (``org/name``: two segments of letters, digits, ``_``,
   ``-`` and ``.``, neither starting nor ending with ``-`` or ``.``, no ``--`` or ``..``, at most
   :data:`MAX_HUB_SEGMENT` characters each) is a Hub repo, unless it looks like a path: its last
   segment ends in a checkpoint file suffix (``.safetensors``, ``.json``, ...), or its first segment
   names something in the current directory (``work/tinyqwn`` beside a ``work/`` folder).
5. Anything else is a local path that does not exist (or a symbolic link to one): the error names
   the nearest existing parent and, when one is close, the entry of that parent the user meant.
"""

from __future__ import annotations

import difflib
import enum
import os
import re
from pathlib import Path

from otfload.errors import SourceNotFoundError

URL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*://")
# The Hub's own limit on an organisation or repo name.
MAX_HUB_SEGMENT = 96
_HUB_SEGMENT = re.compile(r"^[A-Za-z0-9_](?:[\w.-]*[A-Za-z0-9_])?$", re.ASCII)
# Suffixes of the files inside a checkpoint: a location ending in one names a file, never a repo.
FILE_SUFFIXES = (".safetensors", ".json", ".bin", ".pt", ".pth", ".ckpt", ".gguf", ".msgpack", ".h5", ".model")
# How alike (difflib ratio) a sibling must be to be offered as "did you mean".
_CLOSE_NAME_RATIO = 0.75


class Kind(enum.Enum):
    """What a location names."""

    URL = "url"
    LOCAL = "local"
    HUB = "hub"


def could_be_hub_repo_id(text: str) -> bool:
    """Whether the Hub would accept ``text`` as an ``org/name`` repo id (spelling only; nothing is asked)."""
    parts = text.split("/")
    return len(parts) == 2 and all(
        len(p) <= MAX_HUB_SEGMENT and _HUB_SEGMENT.match(p) and "--" not in p and ".." not in p for p in parts
    )


def classify_location(text: str) -> Kind:
    """Where ``text`` points (rules 1-4 of the module docstring); raise ``SourceNotFoundError`` for a
    file or a local path that does not exist (rules 3 and 5), naming what is there instead."""
    if URL.match(text):
        return Kind.URL
    path = Path(text).expanduser()
    if path.is_dir():
        return Kind.LOCAL
    if path.is_symlink() and not path.exists():
        raise SourceNotFoundError(f"checkpoint location {text!r} is a symbolic link to {os.readlink(path)!r}, "
                                  "which does not exist")
    if path.exists():
        raise SourceNotFoundError(
            f"checkpoint location {text!r} is a file, not a checkpoint directory: pass the directory that holds "
            f"config.json and the *.safetensors files (here {_shown_dir(path.parent)!r})"
        )
    first = text.split("/", 1)[0]
    if could_be_hub_repo_id(text) and not text.endswith(FILE_SUFFIXES) and not os.path.lexists(first):
        return Kind.HUB
    raise SourceNotFoundError(_missing_path_message(text, path, hub_shaped=could_be_hub_repo_id(text)))


def _shown_dir(path: Path) -> str:
    text = str(path)
    return text if text.endswith("/") else text + "/"


def _nearest_existing_parent(path: Path) -> Path:
    for parent in path.parents:
        if parent.is_dir():
            return parent
    return Path(".")


def _missing_path_message(text: str, path: Path, *, hub_shaped: bool) -> str:
    """Rule 5's message: the path is missing, where the existing part ends, and a close name there."""
    parent = _nearest_existing_parent(path)
    missing = path.relative_to(parent).parts[0] if path.is_relative_to(parent) else path.name
    where = f"the nearest existing parent is {_shown_dir(parent)!r}" if parent != Path(".") else (
        f"the current directory ({Path.cwd()}) has no {missing!r}")
    sentences = [f"checkpoint location {text!r} is not a local directory: it does not exist; {where}"]
    try:
        siblings = [p.name for p in parent.iterdir()]
    except OSError:
        siblings = []
    close = difflib.get_close_matches(missing, [s for s in siblings if s != missing], n=1, cutoff=_CLOSE_NAME_RATIO)
    if close:
        sentences.append(f"Did you mean {str(parent / close[0])!r}?")
    first = text.split("/", 1)[0]
    if hub_shaped and os.path.lexists(first):
        sentences.append(f"It is not tried as a Hub repo id because {first!r} exists here (for the Hub "
                         f"repo, pass 'hf://{text}')")
    elif hub_shaped:
        sentences.append("A name ending in a file suffix is not tried as a Hub repo id")
    elif "/" not in text:
        sentences.append("A Hub repo id is org/name")
    return " ".join(s if s.endswith("?") else s + "." for s in sentences)


__all__ = ["FILE_SUFFIXES", "MAX_HUB_SEGMENT", "URL", "Kind", "classify_location", "could_be_hub_repo_id"]
