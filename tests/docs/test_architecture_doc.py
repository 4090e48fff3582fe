"""docs/architecture.md names only what exists: every ``otfload/...`` path (and ``pkg/module.py``
under a package of otfload, ``tests/...`` path and entry of the map's tree) is a file or folder of
the checkout, every bare ``module.py`` or ``package/`` in backticks is one somewhere in otfload/,
and every dotted ``otfload.x.y`` name imports (a module) or resolves (an attribute of
one), so the page cannot drift from the code again. The reverse direction (every module is in the
map) is tests/test_architecture.py's."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "architecture.md"
PACKAGES = {p.name for p in (ROOT / "otfload").iterdir() if (p / "__init__.py").exists()}

PATH = re.compile(r"(?<![\w./])((?:otfload|tests)/[\w/.]*\w/?)")
# `sources/base.py`, `index/quant/`: a path relative to otfload/ when it starts with one of its packages.
RELATIVE = re.compile(r"`((\w+)/[\w/.]*)`")
DOTTED = re.compile(r"(?<![\w.])(otfload(?:\.\w+)+)")
BARE = re.compile(r"`(\w+\.py|\w+/)`")
TREE_ENTRY = re.compile(r"(?<=\s)(\w+(?:\.py|/))(?=\s)")


def page_text() -> str:
    return PAGE.read_text()


def the_map() -> str:
    """The text block under "## The map"."""
    section = page_text().split("## The map", 1)[1]
    return section.split("```text", 1)[1].split("```", 1)[0]


def mentioned_paths() -> set[str]:
    text = page_text()
    found = {m.rstrip(".") for m in PATH.findall(text)}
    found |= {f"otfload/{path}" for path, top in RELATIVE.findall(text) if top in PACKAGES}
    # the map's tree: entries after its first line (``otfload/``) are relative to otfload/
    found |= {f"otfload/{entry}" for entry in TREE_ENTRY.findall(" " + the_map().split("\n", 2)[2] + " ")}
    return found


def resolves(name: str) -> bool:
    """Whether ``name`` is a module, or an attribute reached from the longest module prefix of it."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            target: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(target, attr):
                return False
            target = getattr(target, attr)
        return True
    return False


def test_the_page_mentions_paths_and_names():
    """The patterns find what the page is made of (a regex gone wrong would pass everything)."""
    paths, names = mentioned_paths(), set(DOTTED.findall(page_text()))
    assert {"otfload/plan/leaf_bytes.py", "otfload/place/builder.py", "otfload/maxtext/"} <= paths
    assert "tests/test_architecture.py" in paths
    assert len(paths) > 40 and names and len(set(BARE.findall(page_text()))) > 60


def bare_names() -> list[str]:
    return sorted(set(BARE.findall(page_text())))


@pytest.mark.parametrize("name", bare_names())
def test_every_bare_module_exists_somewhere(name):
    here = [p for p in (ROOT / "otfload").rglob(name.rstrip("/")) if p.is_dir() == name.endswith("/")]
    assert here or (ROOT / name).is_dir(), f"docs/architecture.md names {name}, which is nowhere in otfload/"


@pytest.mark.parametrize("path", sorted(mentioned_paths()))
def test_every_path_exists(path):
    assert (ROOT / path).exists(), f"docs/architecture.md names {path}, which does not exist"


@pytest.mark.parametrize("name", sorted(set(DOTTED.findall(page_text()))))
def test_every_dotted_name_resolves(name):
    assert resolves(name), f"docs/architecture.md names {name}, which neither imports nor resolves"
