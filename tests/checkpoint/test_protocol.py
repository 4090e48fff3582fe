from otfload.checkpoint import CheckpointConfig, CheckpointManager, OrbaxCheckpointManager
from otfload.checkpoint.protocol import REQUIRED_METHODS, missing_methods

from .custom_manager import IncompleteManager, NpzCheckpointManager, NpzConfig


def test_protocol_lists_the_manager_methods():
    assert set(REQUIRED_METHODS) == {
        "save", "restore", "metadata", "has_checkpoint", "latest_step", "all_steps", "finalize", "close",
    }  # fmt: skip


def test_default_and_custom_managers_satisfy_the_protocol(tmp_path):
    orbax = OrbaxCheckpointManager(CheckpointConfig(tmp_path / "orbax"))
    custom = NpzCheckpointManager(NpzConfig(tmp_path / "npz"))
    try:
        assert isinstance(orbax, CheckpointManager)
        assert isinstance(custom, CheckpointManager)
        assert missing_methods(OrbaxCheckpointManager) == []
        assert missing_methods(NpzCheckpointManager) == []
    finally:
        orbax.close()


def test_missing_methods_names_absent_and_non_callable_members():
    assert missing_methods(IncompleteManager) == ["restore", "latest_step", "finalize"]
    assert not isinstance(IncompleteManager(None), CheckpointManager)
