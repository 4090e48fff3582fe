"""Output directories that appear whole or not at all.

Everything otfload writes as a directory (an HF checkpoint export, a native checkpoint, a PEFT
adapter) is written into a temporary directory beside the target (``.<name>.tmp-<token>``) and
renamed into place only when complete, so a reader never sees a half-written target: on a failure
the temporary directory is removed and the target is as it was. Replacing an existing target
(``overwrite=True``) moves it aside first (``.<name>.old-<token>``), renames the new one in, then
deletes the old one. It sits below every pipeline stage, next to the errors, so each stage that
writes can use it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from otfload.errors import OutputExistsError

# Characters of a random hex token that keep the temporary names of concurrent writers apart.
TOKEN_CHARS = 8


def output_dir(target: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """``target`` as an absolute path; ``OutputExistsError`` if it exists and not ``overwrite``."""
    target = Path(target).absolute()
    if target.exists() and not overwrite:
        raise OutputExistsError(f"{target} exists; pass overwrite=True to replace it")
    return target


def temp_path(target: Path, token: str | None = None) -> Path:
    """The temporary path beside ``target`` an output (a directory or a file) is written into
    before it is renamed into place (``token``: its suffix)."""
    return target.parent / f".{target.name}.tmp-{token or uuid.uuid4().hex[:TOKEN_CHARS]}"


def commit(tmp: Path, target: Path) -> None:
    """Rename the finished ``tmp`` to ``target``, replacing what is there."""
    if target.exists():
        old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:TOKEN_CHARS]}"
        target.rename(old)
        tmp.rename(target)
        if old.is_dir():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        tmp.rename(target)


@contextlib.contextmanager
def atomic_dir(target: str | os.PathLike[str], overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary directory beside ``target``; on success it replaces ``target``, on
    failure it is removed (``target`` is never left half-written)."""
    path = output_dir(target, overwrite)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    commit(tmp, path)


__all__ = ["atomic_dir", "commit", "output_dir", "temp_path"]
