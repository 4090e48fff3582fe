"""Whole loads from hostile local files, each in a child process under a hard timeout: a deadlock, a
SIGBUS or EMFILE there fails one test instead of killing or hanging the suite.

- a shard truncated after planning (mapped or not, before or after its mapping was made) ends in
  ``TruncatedFileError`` naming the file and the bytes expected vs present, within seconds, with
  every byte of the memory budget given back;
- a checkpoint with more shard files than the process's descriptor limit loads, equal to numpy.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np

from tests.synthetic import write_checkpoint

REPO = Path(__file__).resolve().parents[2]
# Starting Python + JAX in the child takes a few seconds on a busy 2-core host; a hung load would
# take forever, so anything past this is a hang.
CHILD_TIMEOUT_S = 120
# What the failing load itself (after planning) may take: it reads a few MB.
FAIL_BOUND_S = 5.0
# A descriptor limit far below the shard count (the child's own Python + JAX need ~10).
LOW_FD_LIMIT = 64
MANY_SHARDS = 200
VICTIM = "model-00002-of-00002.safetensors"

_PRELUDE = """
import os, sys, time, resource
import jax, numpy as np
from otfload.place.builder import ByteBudget
from otfload.place import loader
from otfload.index.checkpoint import open_index
from otfload.plan.abstract import abstract_from_pytree
from otfload.plan.mapping import as_table
from otfload.plan.planner import build_plan
from otfload.plan.sharding import make_mesh
from otfload.sources import LocalSource

def plan_for(src, names, shape):
    index = open_index(src, require_config=False)
    tree = {k.replace(".", "_"): jax.ShapeDtypeStruct(shape, np.float32) for k in names}
    leaves, treedef = abstract_from_pytree(tree, make_mesh())
    return build_plan(index, leaves, as_table({k.replace(".", "_"): k for k in names}), {}), treedef

budgets = []
class Spy(ByteBudget):  # every budget a load makes, to check that all were given back
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        budgets.append(self)
loader.ByteBudget = Spy
"""

_TRUNCATE = (
    _PRELUDE
    + """
for arg in sys.argv[1:]:  # one checkpoint per mode, moment and truncation length
    mode, when, root, keep = arg.split(":")
    src = LocalSource(root, mmap=(mode == "mmap"))
    names = [f"l.{i}.w" for i in range(8)]
    plan, _ = plan_for(src, names, (256, 1024))
    if when == "after-mapping":
        src.mapped("model-00002-of-00002.safetensors")  # the whole, still complete file is mapped now
    os.truncate(os.path.join(root, "model-00002-of-00002.safetensors"), int(keep))
    start = time.perf_counter()
    try:
        loader.execute_plan(plan, src, workers=2)
        print("RESULT loaded")
    except Exception as e:
        held = sum(b.held for b in budgets)
        print("RESULT", mode, when, keep, type(e).__name__, round(time.perf_counter() - start, 3), "held", held, "|",
              e)
    src.close()
"""
)

_MANY_FILES = (
    _PRELUDE
    + """
root, n = sys.argv[1], int(sys.argv[2])
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[3]), int(sys.argv[3])))
names = [f"t.{i:03d}" for i in range(n)]
for mode in ("mmap", "pread"):
    src = LocalSource(root, mmap=(mode == "mmap"))
    plan, _ = plan_for(src, names, (4, 64))
    start = time.perf_counter()
    arrays, report = loader.execute_plan(plan, src, workers=2)
    for i, k in enumerate(names):
        want = np.arange(4 * 64, dtype=np.float32).reshape(4, 64) + i
        np.testing.assert_array_equal(np.asarray(arrays[k.replace(".", "_")]), want)
    print("RESULT", mode, len(report.files), round(time.perf_counter() - start, 3), "fds", src.max_open_files)
    src.close()
    print("OPEN", mode, len(os.listdir("/proc/self/fd")))
"""
)


def _child(script: str, *args: object) -> str:
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "JAX_PLATFORMS": "cpu",
        "XLA_FLAGS": "--xla_force_host_platform_device_count=8",
    }
    done = subprocess.run(
        [sys.executable, "-c", script, *map(str, args)],
        capture_output=True,
        text=True,
        timeout=CHILD_TIMEOUT_S,
        env=env,
        cwd=REPO,
    )
    assert done.returncode == 0, f"child died (rc {done.returncode}, -7 is SIGBUS):\n{done.stderr[-3000:]}"
    return done.stdout


def _field(out: str, key: str) -> list[str]:
    return next(line.split()[len(key.split()) :] for line in out.splitlines() if line.startswith(key + " "))


def _eight_tensors(root: Path) -> Path:
    """Eight 1 MiB tensors in two shards (four each)."""
    rng = np.random.default_rng(0)
    tensors = {f"l.{i}.w": rng.standard_normal((256, 1024), dtype=np.float32) for i in range(8)}
    return write_checkpoint(root, tensors, files=2)


# Both modes, and a mapping made before and after the truncation, in one child (one Python + JAX start).
MOMENTS = [("mmap", "before-mapping"), ("mmap", "after-mapping"), ("pread", "-")]


def test_a_shard_truncated_after_planning_ends_typed_within_seconds(tmp_path: Path):
    roots = [_eight_tensors(tmp_path / str(i)) for i in range(3 * len(MOMENTS))]
    size = (roots[0] / VICTIM).stat().st_size
    # inside the header (no tensor left), inside the first tensor, one byte short of the whole file
    keeps = [100, 100_000, size - 1]
    cases = [(mode, when, keep) for mode, when in MOMENTS for keep in keeps]
    out = _child(_TRUNCATE, *(f"{m}:{w}:{root}:{k}" for (m, w, k), root in zip(cases, roots, strict=True)))
    results = [line.split() for line in out.splitlines() if line.startswith("RESULT")]
    assert len(results) == len(cases), out
    for (mode, when, keep), (_, got_mode, got_when, kept, kind, seconds, _, held, _, *message) in zip(
        cases, results, strict=True
    ):
        assert (got_mode, got_when, kind, int(kept)) == (mode, when, "TruncatedFileError", keep), out
        assert float(seconds) < FAIL_BOUND_S
        assert held == "0"  # every chunk of every load gave its bytes back to the budget
        assert message[0] == f"{VICTIM}:" and f"has only {keep} bytes" in " ".join(message)


def test_more_shards_than_the_descriptor_limit_load(tmp_path: Path):
    """Mapped and read with ``preadv``, in one child under the low limit."""
    tensors = {f"t.{i:03d}": np.arange(4 * 64, dtype=np.float32).reshape(4, 64) + i for i in range(MANY_SHARDS)}
    root = write_checkpoint(tmp_path / "many", tensors, files=MANY_SHARDS)
    out = _child(_MANY_FILES, root, MANY_SHARDS, LOW_FD_LIMIT)
    for mode in ("mmap", "pread"):
        files, seconds, _, cap = _field(out, f"RESULT {mode}")
        assert int(files) == MANY_SHARDS  # every shard was read, though at most `cap` were open at once
        assert int(cap) == LOW_FD_LIMIT // 2
        assert int(_field(out, f"OPEN {mode}")[0]) < LOW_FD_LIMIT // 2  # closing gave every descriptor back
