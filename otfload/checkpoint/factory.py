"""Create the checkpoint manager named by a config's class path."""

from __future__ import annotations

import importlib

from otfload.checkpoint.config import CheckpointConfig
from otfload.checkpoint.protocol import CheckpointManager, missing_methods


def import_class(path: str) -> type:
    """Import ``"pkg.module:Class"`` or ``"pkg.module.Class"``.

    Raises ``ValueError`` for a malformed path or a name that is not a class, and ``ImportError``
    (chained to the original error) when the module or attribute cannot be found.
    """
    module_name, sep, qualname = path.partition(":") if ":" in path else path.rpartition(".")
    if not sep or not module_name or not qualname:
        raise ValueError(f"class path {path!r} must look like 'pkg.module:Class' or 'pkg.module.Class'")
    try:
        obj = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import module {module_name!r} for class path {path!r}: {err}") from err
    for attr in qualname.split("."):
        try:
            obj = getattr(obj, attr)
        except AttributeError as err:
            raise ImportError(f"{path!r}: {module_name!r} has no attribute {qualname!r}") from err
    if not isinstance(obj, type):
        raise ValueError(f"class path {path!r} names a {type(obj).__name__}, not a class")
    return obj


def create_manager(config: CheckpointConfig) -> CheckpointManager:
    """Instantiate ``config.manager_class`` with ``config``; ``TypeError`` lists any missing methods."""
    cls = import_class(config.manager_class)
    missing = missing_methods(cls)
    if missing:
        raise TypeError(
            f"{config.manager_class!r} does not implement the CheckpointManager protocol: "
            f"missing {', '.join(missing)}"
        )
    manager: CheckpointManager = cls(config)
    return manager
