"""The loader's build order, checked on what a real Hub-protocol server was asked for and when.

The largest leaves go to the builders first (a large leaf left to the end runs at one builder's rate):
from a remote source and from local files read without a read-ahead (warm, or ``O_DIRECT``); local
files read ahead keep the plan's order (the read-ahead announces ranges in it).
"""

from __future__ import annotations

from contextlib import closing
from pathlib import Path

import jax
import numpy as np

from otfload.index.checkpoint import open_index
from otfload.place.loader import build_order, execute_plan
from otfload.plan.abstract import abstract_from_pytree
from otfload.plan.mapping import as_table
from otfload.plan.planner import LoadPlan, build_plan
from otfload.read.reader import TensorReader
from otfload.sources.base import Source
from otfload.sources.hub import HubSource
from otfload.sources.local import LocalSource
from tests.servers.hub_server import HubServer
from tests.synthetic import write_checkpoint

# Rows of each tensor (64 float32 columns): names in plan order are not in size order.
ROWS = {"a": 8, "b": 64, "c": 16, "d": 128, "e": 32}


def _checkpoint(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    tensors = {name: rng.standard_normal((rows, 64), dtype=np.float32) for name, rows in ROWS.items()}
    return write_checkpoint(tmp_path / "ckpt", tensors, files=len(tensors)), tensors


def _plan(source: Source, mesh: jax.sharding.Mesh) -> LoadPlan:
    index = open_index(source, require_config=False)
    tree = {name: jax.ShapeDtypeStruct(index.tensors[name].shape, np.float32) for name in sorted(index.tensors)}
    leaves, _ = abstract_from_pytree(tree, mesh)
    return build_plan(index, leaves, as_table({k: k for k in tree}), {})


def test_remote_builders_take_the_largest_leaves_first(hub: HubServer, tmp_path, mesh_2x4):
    ckpt, tensors = _checkpoint(tmp_path)
    repo = hub.add_repo(f"org/order-{tmp_path.name}", ckpt)
    with closing(HubSource(repo, endpoint=hub.url, cache_dir=tmp_path / "hf")) as source:
        plan = _plan(source, mesh_2x4)
        file_of = {plan.leaves[name].sources[0].file: name for name in plan.leaves}
        hub.reset()  # headers were read while planning: count the load's requests only
        arrays, _ = execute_plan(plan, source, workers=1)  # one builder: leaves start in build order
    asked = [r.path.rsplit("/", 1)[-1] for r in hub.requests("GET", "/resolve/")]
    first_asked = [file_of[f] for f in dict.fromkeys(asked)]
    assert first_asked == sorted(ROWS, key=lambda name: -ROWS[name]) == ["d", "b", "e", "c", "a"]
    assert list(arrays) == list(plan.leaves)  # the result keeps the plan's order
    for name, want in tensors.items():
        np.testing.assert_array_equal(np.asarray(arrays[name]), want)


def test_local_builders_follow_the_plan_only_when_read_ahead(tmp_path, mesh_2x4):
    ckpt, _ = _checkpoint(tmp_path)
    with closing(LocalSource(ckpt)) as source:
        plan = _plan(source, mesh_2x4)
        assert build_order(plan, TensorReader(source), read_ahead=True) == list(plan.leaves) == sorted(ROWS)
        assert build_order(plan, TensorReader(source)) == ["d", "b", "e", "c", "a"]
