"""Run :mod:`tests.cache.fill_script` under a file-size limit or in a private mount namespace."""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 120  # a fill of a few small files, plus interpreter start: seconds; a hang fails
# A user namespace with a mount namespace: mounts made there (a read-only bind, a tiny tmpfs) are
# real for the processes inside and invisible outside; needs no privilege where user namespaces are on.
UNSHARE = ["unshare", "--user", "--map-root-user", "--mount"]


@functools.cache
def private_mounts_available() -> bool:
    """Whether this machine lets us make a private mount namespace (for real EROFS / ENOSPC)."""
    if shutil.which("unshare") is None:
        return False
    with tempfile.TemporaryDirectory() as d:
        probe = subprocess.run([*UNSHARE, "mount", "-t", "tmpfs", "-o", "size=4k", "tmpfs", d],
                               capture_output=True, timeout=30)  # fmt: skip
    return probe.returncode == 0


def run_fills(spec: dict, workdir: Path, mount_script: str | None = None) -> list[dict]:
    """Run the fills of ``spec`` in a new process (after ``mount_script`` in a private mount
    namespace, when given); the outcome of each run."""
    path = workdir / "fill-spec.json"
    path.write_text(json.dumps(spec))
    cmd = [sys.executable, "-m", "tests.cache.fill_script", str(path)]
    if mount_script is not None:
        cmd = [*UNSHARE, "sh", "-ec", f'{mount_script}\nexec "$@"', "sh", *cmd]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"fill script failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])
