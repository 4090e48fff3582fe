"""Which files of a checkpoint location otfload reads, and refusing pickle-only checkpoints."""

from __future__ import annotations

from collections.abc import Iterable

from otfload.errors import UnsafeFormatError

# Remote sources list and fetch only these: tensors, the index and configs. Nothing else is needed.
CHECKPOINT_SUFFIXES = (".safetensors", ".json")
# Formats that need unpickling to read, i.e. can run arbitrary code: never loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


def is_checkpoint_file(name: str) -> bool:
    """Whether ``name`` is a file otfload reads (safetensors shard, index or config JSON)."""
    return name.endswith(CHECKPOINT_SUFFIXES)


def check_safe_format(names: Iterable[str], where: str) -> None:
    """Raise :class:`UnsafeFormatError` if ``names`` hold pickle checkpoints but no safetensors file."""
    names = list(names)
    if any(n.endswith(".safetensors") for n in names):
        return
    pickles = sorted(n for n in names if n.endswith(PICKLE_SUFFIXES))
    if pickles:
        shown = ", ".join(pickles[:3]) + (", ..." if len(pickles) > 3 else "")
        raise UnsafeFormatError(
            f"{where} holds only pickle checkpoints ({shown}), which can execute code when loaded; "
            "otfload reads safetensors only: convert the checkpoint to safetensors "
            "(e.g. model.save_pretrained(dir, safe_serialization=True)) or use a repo that has them"
        )
