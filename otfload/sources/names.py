"""One check for the file names a source or an index hands otfload, wherever they are used.

A name must be a plain relative POSIX path inside the checkpoint: a non-empty ``str`` of
``/``-separated segments, none of them empty, ``.`` or ``..``; no leading ``/``, no drive letter, no
backslash, no URL, no control character, valid UTF-8 and of bounded length. A listing must also
name each file once and never use one name both as a file and as a folder (``a.safetensors`` and
``a.safetensors/b.safetensors``). The index raises :class:`~otfload.errors.CheckpointIndexError`,
the shard cache :class:`~otfload.errors.CacheUnsafeNameError`; the message names the bad name.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Callable, Iterable

from otfload.errors import CheckpointIndexError, OtfloadError

# Bytes (UTF-8) of a whole name: far above any real checkpoint's (``model-00001-of-00163...`` is
# ~40), and with a cache prefix still under GCS's 1024-byte object-name limit.
MAX_NAME_BYTES = 512
# Bytes of one segment: NAME_MAX is 255, and the shard cache puts its hidden temporaries
# (``.NAME.partial-<host>-<pid>-<random>``) and records (``NAME.sha256``) next to a file.
MAX_SEGMENT_BYTES = 200
# Unicode categories never in a file name a person chose: controls (NUL, newline, ESC, DEL, C1),
# and line/paragraph separators (they split log lines as a newline does).
_FORBIDDEN_CATEGORIES = frozenset({"Cc", "Zl", "Zp"})
_DRIVE = re.compile(r"^[A-Za-z]:")
_SHOWN_CHARS = 120  # a hostile name may be huge; messages show its start


def _shown(name: object) -> str:
    text = repr(name)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _outside_reason(name: str) -> str | None:
    if "://" in name:
        return "a URL"
    if name.startswith("/"):
        return "an absolute path"
    if "\\" in name:
        return "a backslash"
    if _DRIVE.match(name):
        return "a drive letter"
    if ".." in name.split("/"):
        return "a '..' segment"
    return None


def check_member_name(
    name: object, where: str, error: type[OtfloadError] = CheckpointIndexError, what: str = "file name"
) -> str:
    """``name`` itself when it is a plain relative name inside the checkpoint; else raise ``error``.

    ``where`` (a file or source description) and ``what`` prefix the message.
    """
    if not isinstance(name, str) or not name:
        raise error(f"{where}: {what} {_shown(name)} is not a string naming a file")
    if (why := _outside_reason(name)) is not None:
        raise error(f"{where}: {what} {_shown(name)} is outside the checkpoint ({why})")
    if bad := next((c for c in name if unicodedata.category(c) in _FORBIDDEN_CATEGORIES), None):
        raise error(f"{where}: {what} {_shown(name)} contains the control character {bad!r}")
    try:
        size = len(name.encode("utf-8"))
    except UnicodeEncodeError:
        raise error(f"{where}: {what} {_shown(name)} is not valid UTF-8") from None
    if size > MAX_NAME_BYTES:
        raise error(f"{where}: {what} {_shown(name)} is {size} bytes long, more than {MAX_NAME_BYTES}")
    for segment in name.split("/"):
        if segment in ("", "."):
            raise error(f"{where}: {what} {_shown(name)} is not a plain name (empty or '.' segment)")
        if len(segment.encode("utf-8")) > MAX_SEGMENT_BYTES:
            raise error(f"{where}: {what} {_shown(name)} has a segment longer than {MAX_SEGMENT_BYTES} bytes")
    return name


def checked_listing(
    names: Iterable[object],
    where: str,
    error: type[OtfloadError] = CheckpointIndexError,
    keep: Callable[[str], bool] | None = None,
) -> list[str]:
    """The sorted names of a source's listing, each checked by :func:`check_member_name`, listed once,
    and none a folder of another; else raise ``error`` naming the offending name(s).

    ``keep`` limits the check (and the result) to the string names it accepts, e.g. the files a load
    reads; a name that is not a string is always an error.
    """
    seen: set[str] = set()
    for name in names:
        if keep is not None and isinstance(name, str) and not keep(name):
            continue
        checked = check_member_name(name, where, error, "listed file name")
        if checked in seen:
            raise error(f"{where}: file {_shown(checked)} is listed twice")
        seen.add(checked)
    for name in sorted(seen):
        parts = name.split("/")
        for depth in range(1, len(parts)):
            folder = "/".join(parts[:depth])
            if folder in seen:
                raise error(f"{where}: {_shown(folder)} is listed both as a file and as a folder (of {_shown(name)})")
    return sorted(seen)


__all__ = ["MAX_NAME_BYTES", "MAX_SEGMENT_BYTES", "check_member_name", "checked_listing"]
