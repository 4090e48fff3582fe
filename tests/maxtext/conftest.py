"""The MaxText tests' shared fixture: the tiny checkpoints and transformers' reference logits."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"


@pytest.fixture(scope="session")
def refs(tmp_path_factory) -> Path:
    """The tiny checkpoints and transformers' logits (``make_refs.py``), written once per session by
    the main venv (torch lives there)."""
    root = tmp_path_factory.mktemp("maxtext_refs")
    subprocess.run([str(MAIN_PYTHON), str(ROOT / "tests" / "maxtext" / "make_refs.py"), str(root)], check=True,
                   cwd=ROOT, capture_output=True)
    return root
