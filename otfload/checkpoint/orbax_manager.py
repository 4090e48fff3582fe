"""The default :class:`CheckpointManager`, on Orbax: async saves, atomic commit, keeps the N latest.

Each step directory holds one Orbax PyTree item named ``"state"`` (the name Orbax v1 gives a saved
PyTree, so :meth:`OrbaxCheckpointManager.save_in_parts` can write into the same layout) and the
:class:`LayoutMetadata` as the step's custom metadata under ``"otfload_layout"``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from orbax.checkpoint import checkpoint_managers
from orbax.checkpoint.experimental import v1 as ocp_v1

from otfload.checkpoint.config import CheckpointConfig
from otfload.checkpoint.layout import detect_scan_layers
from otfload.checkpoint.metadata import LayoutMetadata
from otfload.checkpoint.paths import flatten_tree
from otfload.checkpoint.protocol import PyTree, resolve_checkpoint_scan_layers
from otfload.errors import NativeCheckpointError

ITEM = "state"
METADATA_KEY = "otfload_layout"


class OrbaxCheckpointManager:
    """A :class:`~otfload.checkpoint.protocol.CheckpointManager` backed by ``orbax.checkpoint``.

    A step is listed only once Orbax has committed it (written to a temporary directory, then
    renamed), so a save interrupted by a crash never shows up as the latest step.
    """

    def __init__(self, config: CheckpointConfig):
        self.config = config
        self.directory = Path(config.directory).absolute()
        preservation = checkpoint_managers.LatestN(config.max_to_keep) if config.max_to_keep else None
        options = ocp.CheckpointManagerOptions(
            save_interval_steps=config.save_interval_steps,
            enable_async_checkpointing=config.async_save,
            preservation_policy=preservation,
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory,
            item_names=(ITEM,),
            item_handlers={ITEM: ocp.PyTreeCheckpointHandler()},
            options=options,
        )

    # --- saving ----------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        state: PyTree,
        *,
        metadata: LayoutMetadata | None = None,
        force: bool = False,
        wait: bool = False,
    ) -> bool:
        """Start saving ``state`` as ``step``; unset metadata fields are filled in from ``state``."""
        layout = (metadata or LayoutMetadata()).completed_for(state)
        started: bool = self._manager.save(
            step,
            args=ocp.args.Composite(**{ITEM: ocp.args.PyTreeSave(state)}),
            custom_metadata={METADATA_KEY: layout.to_json()},
            force=force,
        )
        if wait:
            self.finalize()
        return started

    def save_in_parts(self, step: int, parts: Iterable[PyTree], *, metadata: LayoutMetadata) -> None:
        """Save ``step`` from disjoint subtrees written one after another, so that only one part
        needs to be in memory at a time; the step becomes visible atomically after the last part."""
        self.finalize()
        if step in self.all_steps():
            raise NativeCheckpointError(f"step {step} already exists in {self.directory}")
        path = self.directory / str(step)  # Orbax's default step name format
        custom = {METADATA_KEY: metadata.to_json()}
        wrote = False
        for part in parts:
            ocp_v1.partial.save(path, part, custom_metadata=custom)
            del part  # let it be freed while the next part is produced
            wrote = True
        if not wrote:
            raise NativeCheckpointError(f"save_in_parts({step}) was given no parts")
        ocp_v1.partial.finalize(path)
        self._manager.reload()

    # --- reading ---------------------------------------------------------------------------------

    def restore(self, step: int | None, abstract_tree: PyTree, *, scan_layers: bool | None = None) -> PyTree:
        """Restore into ``abstract_tree`` (``jax.ShapeDtypeStruct`` leaves with shardings).

        The tree's own layer layout counts as the request when ``scan_layers`` is ``None``.
        """
        step = self.resolve_step(step)
        if scan_layers is None:
            scan_layers = detect_scan_layers(flatten_tree(abstract_tree))
        resolve_checkpoint_scan_layers(self, scan_layers, step)
        return self.restore_leaves(step, abstract_tree, partial=False)

    def restore_leaves(self, step: int, abstract_tree: PyTree, *, partial: bool = True) -> PyTree:
        """Restore the leaves named by ``abstract_tree`` (a subtree of the saved one if ``partial``),
        without the ``scan_layers`` check: the building block of bounded-memory rewrites."""
        args = ocp.args.PyTreeRestore(
            item=abstract_tree,
            restore_args=ocp.checkpoint_utils.construct_restore_args(abstract_tree),
            partial_restore=partial,
        )
        try:
            return self._manager.restore(step, args=ocp.args.Composite(**{ITEM: args}))[ITEM]
        except (ValueError, KeyError, FileNotFoundError) as err:
            raise NativeCheckpointError(f"cannot restore step {step} from {self.directory}: {err}") from err

    def leaf_specs(self, step: int | None = None) -> dict[str, jax.ShapeDtypeStruct]:
        """``{dotted path: ShapeDtypeStruct}`` (no sharding) of every leaf saved at ``step``."""
        tree = self._manager.item_metadata(self.resolve_step(step))[ITEM]
        return {
            path: jax.ShapeDtypeStruct(tuple(leaf.shape), leaf.dtype)  # type: ignore[no-untyped-call]  # jax: untyped
            for path, leaf in flatten_tree(tree.tree).items()
        }

    def metadata(self, step: int | None = None) -> LayoutMetadata | None:
        """The :class:`LayoutMetadata` saved with ``step``, or ``None`` for a foreign checkpoint."""
        custom = self._manager.metadata(self.resolve_step(step)).custom_metadata or {}
        return LayoutMetadata.from_json(custom[METADATA_KEY]) if METADATA_KEY in custom else None

    def has_checkpoint(self) -> bool:
        """Whether a committed step exists."""
        return self.latest_step() is not None

    def latest_step(self) -> int | None:
        """The newest committed step, or ``None``."""
        step: int | None = self._manager.latest_step()
        return step

    def all_steps(self) -> Sequence[int]:
        """Every committed step, ascending."""
        return sorted(self._manager.all_steps())

    def resolve_step(self, step: int | None) -> int:
        """``step``, or the latest one when ``None``; ``NativeCheckpointError`` if it does not exist."""
        resolved = self.latest_step() if step is None else step
        if resolved is None or resolved not in self.all_steps():
            what = "no checkpoint" if resolved is None else f"no step {resolved}"
            raise NativeCheckpointError(f"{what} in {self.directory}")
        return resolved

    # --- lifecycle -------------------------------------------------------------------------------

    def finalize(self) -> None:
        """Wait for pending async saves to commit; re-raise a failed save's error."""
        self._manager.wait_until_finished()
        self._manager.check_for_errors()

    def close(self) -> None:
        """Finalize, then release Orbax's threads."""
        self.finalize()
        self._manager.close()

    def __enter__(self) -> OrbaxCheckpointManager:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
