"""The lm_eval task names a job asks for, checked in ~2 s before anything else runs.

lm_eval's ``TaskManager`` parses each of its ~14k task YAML files to index them (~20 s, more on a
busy machine), so a misspelt ``--tasks`` name used to be found only then. Every name the index
knows is written in one of those files (a ``task:``, ``group:`` or ``tag:`` value; a task class is
named by the YAML that uses it), so a name that no file's text contains is certainly no task: that
much is a byte search. The names the files define (read with a pattern, not a YAML parser) give the
did-you-mean; a name some file mentions is left to lm_eval's own index to decide.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections.abc import Iterator
from pathlib import Path

TASK_FILE_SUFFIXES = (".yaml", ".yml")
PATTERN = re.compile(r"[*?\[]")  # a glob, as lm_eval's match_tasks takes
DEFINED = re.compile(rb"^\s*-?\s*(?:task|group|tag)\s*:\s*['\"]?([\w.\-]+)", re.M)


def task_files(include_path: str | None) -> Iterator[Path]:
    """The task YAML files lm_eval indexes: those under ``include_path``, then its built-in ones
    (found without importing lm_eval)."""
    spec = importlib.util.find_spec("lm_eval")
    roots = [Path(spec.origin).parent / "tasks"] if spec is not None and spec.origin else []
    for root in [*([Path(include_path)] if include_path else []), *roots]:
        for directory, _, names in os.walk(root):
            yield from (Path(directory, n) for n in names if n.endswith(TASK_FILE_SUFFIXES))


def unmentioned(tasks: list[str], include_path: str | None) -> tuple[list[str], list[str]]:
    """``(names, defined)``: the names in ``tasks`` that no task file mentions and that are neither a
    file path nor a pattern (``mmlu_*``: lm_eval matches those itself), certainly no lm_eval task; and
    the names the files define (for suggestions; complete only when some name is missing: the
    search stops once every name is found)."""
    left = {t.encode() for t in tasks if not os.path.exists(t) and not PATTERN.search(t)}
    defined: set[bytes] = set()
    for path in task_files(include_path):
        if not left:  # every name is mentioned: the suggestions are not needed
            break
        text = path.read_bytes()
        defined.update(DEFINED.findall(text))
        left = {name for name in left if name not in text}
    return [t for t in tasks if t.encode() in left], sorted(n.decode() for n in defined)


__all__ = ["DEFINED", "PATTERN", "task_files", "unmentioned"]
