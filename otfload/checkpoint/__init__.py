"""Native checkpoints: a pluggable :class:`CheckpointManager`, layout metadata, layout conversion, re-saving for a mesh.

Typical use::

    manager = create_manager(CheckpointConfig("/ckpt/run1"))
    manager.save(step, state, metadata=LayoutMetadata(scan_layers=True, model_type="llama"))
    manager.finalize()
    if manager.has_checkpoint():
        state = manager.restore(None, abstract_state)
"""

from otfload.checkpoint.config import CheckpointConfig
from otfload.checkpoint.factory import create_manager, import_class
from otfload.checkpoint.layout import detect_scan_layers, stack_layers, unstack_layers
from otfload.checkpoint.metadata import LayoutMetadata, MissingLayoutMetadataWarning, resolve_scan_layers
from otfload.checkpoint.orbax_manager import OrbaxCheckpointManager
from otfload.checkpoint.protocol import CheckpointManager, resolve_checkpoint_scan_layers
from otfload.checkpoint.resave import reshard_checkpoint

__all__ = [
    "CheckpointConfig",
    "CheckpointManager",
    "LayoutMetadata",
    "MissingLayoutMetadataWarning",
    "OrbaxCheckpointManager",
    "create_manager",
    "detect_scan_layers",
    "import_class",
    "reshard_checkpoint",
    "resolve_checkpoint_scan_layers",
    "resolve_scan_layers",
    "stack_layers",
    "unstack_layers",
]
