"""The MaxText tests' shared fixture: the tiny checkpoints and transformers' reference logits."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import jax
import pytest

ROOT = Path(__file__).resolve().parents[2]
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"

# MaxText's loader jit-compiles a stacking program per leaf shape and its models share blocks, so the
# tiny families compile the same programs again and again under new function objects: XLA's persistent
# cache, every program kept however fast it compiled, serves them once compiled (301 -> 250 CPU-s for
# tests/maxtext from a fresh home). The cache lives in a directory of this run (made by the first process, xdist's
# controller, and inherited by its workers), never in MaxText's default ``~/jax_cache``:
# ``reference.build`` turns MaxText's own cache setting off.
CACHE_ENV = "OTFLOAD_TEST_MAXTEXT_JAX_CACHE"
if CACHE_ENV not in os.environ:
    os.environ[CACHE_ENV] = tempfile.mkdtemp(prefix="otfload-test-maxtext-xla-")
CACHE_DIR = os.environ[CACHE_ENV]
jax.config.update("jax_compilation_cache_dir", CACHE_DIR)
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@pytest.fixture(scope="session")
def refs(tmp_path_factory) -> Path:
    """The tiny checkpoints and transformers' logits (``make_refs.py``), written once per session by
    the main venv (torch lives there)."""
    root = tmp_path_factory.mktemp("maxtext_refs")
    subprocess.run([str(MAIN_PYTHON), str(ROOT / "tests" / "maxtext" / "make_refs.py"), str(root)], check=True,
                   cwd=ROOT, capture_output=True)
    return root
