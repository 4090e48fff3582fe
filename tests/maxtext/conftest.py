"""The MaxText tests' shared fixture: the tiny checkpoints and transformers' reference logits."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.maxtext.models import done_marker, failed_marker, written

ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
WAIT_S = 600  # for the families another worker writes


@pytest.fixture(scope="session")
def refs(tmp_path_factory) -> Path:
    """The tiny checkpoints and transformers' logits (``make_refs.py``), written once per session by
    the main venv (torch lives there). Under pytest-xdist the workers share one directory: each one's
    ``make_refs.py`` writes the families no other has claimed, then it waits for the others'."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = tmp_path_factory.getbasetemp().parent / "maxtext_refs"  # the session's, above the workers'
    else:
        root = tmp_path_factory.mktemp("maxtext_refs")
    subprocess.run([str(MAIN_PYTHON), str(ROOT / "tests" / "maxtext" / "make_refs.py"), str(root)], check=True,
                   cwd=ROOT, capture_output=True)
    deadline = time.monotonic() + WAIT_S
    while not all(done_marker(root, name).exists() for name in written()):
        if failed_marker(root).exists():
            pytest.fail(f"make_refs.py failed in another worker:\n{failed_marker(root).read_text()}")
        if time.monotonic() > deadline:
            pytest.fail(f"the reference checkpoints in {root} were not all written within {WAIT_S} s")
        time.sleep(0.1)
    return root
