"""Configuration of a checkpoint manager; subclass it to give a custom manager its own fields."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_MANAGER = "otfload.checkpoint.orbax_manager:OrbaxCheckpointManager"


@dataclass
class CheckpointConfig:
    """Where checkpoints live and which :class:`CheckpointManager` class stores them.

    ``manager_class`` is a class path, ``"pkg.module:Class"`` or ``"pkg.module.Class"``.
    ``max_to_keep=None`` keeps every step.
    """

    directory: str | os.PathLike[str]
    manager_class: str = DEFAULT_MANAGER
    max_to_keep: int | None = 3
    async_save: bool = True
    save_interval_steps: int = 1
