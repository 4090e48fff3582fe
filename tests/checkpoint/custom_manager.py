"""A third-party-style CheckpointManager for the factory tests: one ``.npz`` file per step.

It is deliberately unlike Orbax: synchronous, a ``LATEST`` marker file decides what can be restored,
and its config subclass adds a field of its own.
"""

import json
import os
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from otfload.checkpoint import CheckpointConfig, LayoutMetadata, resolve_checkpoint_scan_layers
from otfload.checkpoint.paths import flatten_tree, unflatten_tree


@dataclass
class NpzConfig(CheckpointConfig):
    """Adds the file-name prefix, a field only this manager knows."""

    prefix: str = "ckpt"


class NpzCheckpointManager:
    """Saves flat ``{dotted path: array}`` dicts with ``np.savez``; restores with ``jax.device_put``."""

    def __init__(self, config: NpzConfig):
        self.config = config
        self.root = Path(config.directory)
        self.root.mkdir(parents=True, exist_ok=True)

    def _file(self, step: int, suffix: str) -> Path:
        return self.root / f"{self.config.prefix}_{step}{suffix}"

    def save(self, step, state, *, metadata=None, force=False, wait=False):
        arrays = {k: np.asarray(v) for k, v in flatten_tree(state).items()}
        np.savez(self._file(step, ".npz"), **arrays)
        layout = (metadata or LayoutMetadata()).completed_for(state)
        self._file(step, ".json").write_text(json.dumps(layout.to_json()))
        tmp = self.root / "LATEST.tmp"
        tmp.write_text(str(step))
        os.replace(tmp, self.root / "LATEST")
        return True

    def restore(self, step, abstract_tree, *, scan_layers=None):
        step = self.latest_step() if step is None else step
        resolve_checkpoint_scan_layers(self, scan_layers, step)
        with np.load(self._file(step, ".npz")) as data:
            flat = {
                k: jax.device_put(data[k].astype(spec.dtype), spec.sharding)
                for k, spec in flatten_tree(abstract_tree).items()
            }
        return unflatten_tree(flat)

    def metadata(self, step=None):
        step = self.latest_step() if step is None else step
        path = self._file(step, ".json")
        return LayoutMetadata.from_json(json.loads(path.read_text())) if path.exists() else None

    def has_checkpoint(self):
        return (self.root / "LATEST").exists()

    def latest_step(self):
        return int((self.root / "LATEST").read_text()) if self.has_checkpoint() else None

    def all_steps(self):
        return sorted(int(p.stem.rpartition("_")[2]) for p in self.root.glob(f"{self.config.prefix}_*.npz"))

    def finalize(self):
        """Saves are synchronous: nothing to wait for."""

    def close(self):
        """Nothing to release."""


class IncompleteManager:
    """Lacks ``restore`` and ``finalize``; ``latest_step`` is not callable."""

    latest_step = 3

    def __init__(self, config):
        self.config = config

    def save(self, step, state, *, metadata=None, force=False, wait=False):
        return False

    def metadata(self, step=None):
        return None

    def has_checkpoint(self):
        return False

    def all_steps(self):
        return []

    def close(self):
        pass


not_a_class = object()
