import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from otfload.checkpoint import CheckpointConfig, LayoutMetadata, OrbaxCheckpointManager
from otfload.errors import NativeCheckpointError

from .helpers import abstract, assert_trees_equal, scanned_state

REPO = Path(__file__).resolve().parents[2]


def _manager(directory, **config) -> OrbaxCheckpointManager:
    return OrbaxCheckpointManager(CheckpointConfig(directory, **config))


def test_save_restore_on_2x4_mesh_keeps_values_and_shardings(tmp_path, mesh):
    state = scanned_state(mesh)
    with _manager(tmp_path) as manager:
        manager.save(3, state, metadata=LayoutMetadata(model_type="llama"), wait=True)
        restored = manager.restore(3, abstract(state))
    assert_trees_equal(restored, state)


def test_restore_places_leaves_on_the_requested_shardings(tmp_path, mesh):
    state = scanned_state(mesh)
    other = NamedSharding(mesh, PartitionSpec(None, "tp"))
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=other), state)
    with _manager(tmp_path) as manager:
        manager.save(1, state, wait=True)
        restored = manager.restore(None, target)
    for leaf in jax.tree.leaves(restored):
        assert leaf.sharding == other
    assert_trees_equal(restored, jax.tree.map(lambda x: jax.device_put(x, other), state))


def test_async_save_then_finalize_is_complete_on_disk(tmp_path, mesh):
    state = scanned_state(mesh)
    with _manager(tmp_path, async_save=True) as manager:
        assert manager.save(7, state)
        manager.finalize()
        assert manager.latest_step() == 7
    assert sorted(os.listdir(tmp_path)) == ["7"]  # committed: no temporary directory left
    assert (tmp_path / "7" / "state" / "_METADATA").is_file()
    with _manager(tmp_path) as reopened:  # a fresh process view
        assert reopened.has_checkpoint()
        assert_trees_equal(reopened.restore(7, abstract(state)), state)


def test_keeps_only_the_latest_n_and_respects_the_interval(tmp_path, mesh):
    state = scanned_state(mesh)
    with _manager(tmp_path, max_to_keep=2, save_interval_steps=2) as manager:
        started = [manager.save(step, state) for step in range(1, 7)]
        assert manager.save(7, state, force=True)
        manager.finalize()
        assert started == [True, True, False, True, False, True]  # Orbax always saves the first step
        assert manager.all_steps() == [6, 7]


def test_empty_directory_has_nothing_to_restore(tmp_path, mesh):
    with _manager(tmp_path) as manager:
        assert not manager.has_checkpoint()
        assert manager.latest_step() is None and manager.all_steps() == []
        with pytest.raises(NativeCheckpointError, match="no checkpoint"):
            manager.restore(None, abstract(scanned_state(mesh)))
        manager.save(1, scanned_state(mesh), wait=True)
        with pytest.raises(NativeCheckpointError, match="no step 2"):
            manager.metadata(2)


def test_restore_into_wrong_tree_is_a_typed_error(tmp_path, mesh):
    state = scanned_state(mesh)
    with _manager(tmp_path) as manager:
        manager.save(1, state, wait=True)
        wrong = {"model": {**abstract(state)["model"], "extra": abstract(state)["model"]["embed"]}}
        with pytest.raises(NativeCheckpointError, match="cannot restore step 1"):
            manager.restore(1, wrong)


def test_killed_save_leaves_previous_checkpoint_latest_and_loadable(tmp_path, mesh):
    state = scanned_state(mesh)
    with _manager(tmp_path) as manager:
        manager.save(1, state, wait=True)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    }
    child = subprocess.Popen(
        [sys.executable, "-m", "tests.checkpoint.interrupted_save", str(tmp_path), "256"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )  # fmt: skip
    try:
        assert child.stdout.readline().strip() == "SAVING"
        deadline = time.monotonic() + 30
        while not [p for p in os.listdir(tmp_path) if p.startswith("2")] and time.monotonic() < deadline:
            time.sleep(0.005)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=30) == -signal.SIGKILL
    finally:
        child.kill()
    leftovers = [p for p in os.listdir(tmp_path) if p != "1"]
    assert leftovers and all("tmp" in p for p in leftovers), leftovers  # killed mid-way, uncommitted
    with _manager(tmp_path) as manager:
        assert manager.all_steps() == [1] and manager.latest_step() == 1
        assert_trees_equal(manager.restore(None, abstract(state)), state)
