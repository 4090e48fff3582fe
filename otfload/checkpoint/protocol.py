"""The ``CheckpointManager`` protocol: what otfload needs from a native checkpoint store."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from otfload.checkpoint.metadata import LayoutMetadata, resolve_scan_layers

PyTree = Any


@runtime_checkable
class CheckpointManager(Protocol):
    """Saves and restores a series of step checkpoints of a (sharded) state tree.

    Implementations are constructed with one argument, their
    :class:`~otfload.checkpoint.config.CheckpointConfig` (or a subclass of it), and are loaded by class
    path with :func:`~otfload.checkpoint.factory.create_manager`.
    """

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        metadata: LayoutMetadata | None = None,
        force: bool = False,
        wait: bool = False,
    ) -> bool:
        """Save ``state`` as ``step`` with its layout ``metadata``; return whether a save started.

        The save may finish in the background unless ``wait``; ``force`` bypasses the save interval.
        """
        ...

    def restore(self, step: int | None, abstract_tree: PyTree, *, scan_layers: bool | None = None) -> PyTree:
        """Restore ``step`` (``None``: the latest) into ``abstract_tree``'s shapes, dtypes and shardings.

        ``scan_layers`` is the caller's request, checked against the saved metadata with
        :func:`~otfload.checkpoint.metadata.resolve_scan_layers`.
        """
        ...

    def metadata(self, step: int | None = None) -> LayoutMetadata | None:
        """The layout metadata saved with ``step`` (``None``: the latest), or ``None`` if there is none."""
        ...

    def has_checkpoint(self) -> bool:
        """Whether there is a complete checkpoint to restore (the manager decides, not the caller)."""
        ...

    def latest_step(self) -> int | None:
        """The newest complete step, or ``None``."""
        ...

    def all_steps(self) -> Sequence[int]:
        """Every complete step, ascending."""
        ...

    def finalize(self) -> None:
        """Block until pending asynchronous saves are committed; re-raise their errors."""
        ...

    def close(self) -> None:
        """Finalize and release resources."""
        ...


REQUIRED_METHODS: tuple[str, ...] = tuple(
    name for name, value in vars(CheckpointManager).items() if callable(value) and not name.startswith("_")
)


def missing_methods(cls: type) -> list[str]:
    """The protocol methods ``cls`` does not define (as callables)."""
    return [name for name in REQUIRED_METHODS if not callable(getattr(cls, name, None))]


def resolve_checkpoint_scan_layers(
    manager: CheckpointManager, requested: bool | None, step: int | None = None
) -> bool:
    """Apply :func:`resolve_scan_layers` to the metadata ``manager`` saved with ``step`` (or the latest)."""
    saved = manager.metadata(step)
    where = f"the checkpoint at step {step}" if step is not None else "the latest checkpoint"
    return resolve_scan_layers(requested, None if saved is None else saved.scan_layers, source=where)
