import jax
import numpy as np
import pytest

from otfload.checkpoint import CheckpointConfig, LayoutMetadata, OrbaxCheckpointManager, create_manager
from otfload.checkpoint.factory import import_class

from . import custom_manager
from .custom_manager import NpzCheckpointManager, NpzConfig
from .helpers import abstract, assert_trees_equal, scanned_state

MODULE = custom_manager.__name__


@pytest.mark.parametrize("sep", [":", "."])
def test_import_class_accepts_both_path_forms(sep):
    assert import_class(f"{MODULE}{sep}NpzCheckpointManager") is NpzCheckpointManager


def test_default_config_creates_the_orbax_manager(tmp_path):
    manager = create_manager(CheckpointConfig(tmp_path))
    assert isinstance(manager, OrbaxCheckpointManager)
    manager.close()


def test_custom_manager_by_class_path_end_to_end(tmp_path, mesh):
    config = NpzConfig(tmp_path, manager_class=f"{MODULE}:NpzCheckpointManager", prefix="run7")
    manager = create_manager(config)
    assert isinstance(manager, NpzCheckpointManager)
    assert not manager.has_checkpoint()
    state = scanned_state(mesh)
    assert manager.save(5, state, metadata=LayoutMetadata(model_type="llama"))
    manager.finalize()
    assert (tmp_path / "run7_5.npz").exists()  # the subclass field reached the manager
    assert manager.has_checkpoint() and manager.latest_step() == 5 and manager.all_steps() == [5]
    assert manager.metadata().model_type == "llama"
    assert manager.metadata().mesh_axes == {"fsdp": 2, "tp": 4}
    assert_trees_equal(manager.restore(None, abstract(state)), state)


def test_incomplete_class_raises_type_error_naming_missing_methods(tmp_path):
    config = CheckpointConfig(tmp_path, manager_class=f"{MODULE}:IncompleteManager")
    with pytest.raises(TypeError, match="missing restore, latest_step, finalize"):
        create_manager(config)


def test_missing_module_raises_chained_import_error(tmp_path):
    with pytest.raises(ImportError, match="no_such_pkg.mod") as info:
        create_manager(CheckpointConfig(tmp_path, manager_class="no_such_pkg.mod:Manager"))
    assert isinstance(info.value.__cause__, ModuleNotFoundError)


def test_missing_attribute_raises_chained_import_error(tmp_path):
    with pytest.raises(ImportError, match="NoSuchManager") as info:
        create_manager(CheckpointConfig(tmp_path, manager_class=f"{MODULE}.NoSuchManager"))
    assert isinstance(info.value.__cause__, AttributeError)


@pytest.mark.parametrize("path", ["JustAName", ":Class", f"{MODULE}:", f"{MODULE}:not_a_class"])
def test_malformed_path_or_non_class_raises_value_error(path):
    with pytest.raises(ValueError, match="class path"):
        import_class(path)


def test_custom_manager_restores_onto_another_sharding(tmp_path, mesh):
    manager = create_manager(NpzConfig(tmp_path, manager_class=f"{MODULE}:NpzCheckpointManager"))
    state = scanned_state(mesh)
    manager.save(1, state)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated), state)
    restored = manager.restore(1, target)
    for leaf, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state), strict=True):
        assert leaf.sharding == replicated
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(want))
