"""One check per kind of option value, each an :class:`~otfload.errors.InvalidOptionError` naming the
option (a keyword, a field, or a ``$OTFLOAD_*`` variable), the value and what is allowed.

Used by :class:`~otfload.options.LoadOptions` when it is made and by
:mod:`otfload.options.environment` when the environment is read: a value is checked once, where it
enters, and passed down already typed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ml_dtypes
import numpy as np

from otfload.errors import InvalidOptionError

if TYPE_CHECKING:
    from jax.sharding import Mesh

# The dtypes a load casts a bundled model's parameters to ("auto" and None: the storage dtype).
CAST_DTYPES = (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32), np.dtype(np.float64))
_CAST_NAMES = "'bf16', 'fp16', 'float32', 'float64' (or a numpy/jax float dtype), 'auto' or None"


def flag(name: str, value: object) -> bool:
    """``value`` when it is a bool (``"no"`` or ``0`` are refused, not read as truthy)."""
    if isinstance(value, bool | np.bool_):
        return bool(value)
    raise InvalidOptionError(f"{name}={value!r}: expected True or False")


def optional_flag(name: str, value: object) -> bool | None:
    """:func:`flag`, or None (the default decides)."""
    return None if value is None else flag(name, value)


def one_of(name: str, value: object, allowed: Sequence[str]) -> str:
    """``value`` when it is one of ``allowed``."""
    if isinstance(value, str) and value in allowed:
        return value
    raise InvalidOptionError(f"{name}={value!r}: expected one of {', '.join(map(repr, allowed))}")


def count(name: str, value: object, *, least: int = 1) -> int | None:
    """An integer ``>= least`` (not a bool, not a string), or None."""
    if value is None:
        return None
    if isinstance(value, int | np.integer) and not isinstance(value, bool | np.bool_) and value >= least:
        return int(value)
    raise InvalidOptionError(f"{name}={value!r}: expected an integer >= {least} or None")


def seconds(name: str, value: object) -> float | None:
    """A finite number of seconds > 0, or None."""
    if value is None:
        return None
    ok = isinstance(value, int | float | np.integer | np.floating) and not isinstance(value, bool | np.bool_)
    if ok and 0 < float(value) < math.inf:  # type: ignore[arg-type]  # a number, checked just above
        return float(value)  # type: ignore[arg-type]
    raise InvalidOptionError(f"{name}={value!r}: expected a number of seconds > 0 or None")


def cast_dtype(name: str, value: object) -> np.dtype[Any] | None:
    """A float dtype a load can cast to (a name such as ``"bf16"``, a numpy or jax dtype); ``"auto"``
    and None keep the storage dtype."""
    if value is None or (isinstance(value, str) and value.lower() == "auto"):
        return None
    from otfload.index.dtypes import to_numpy_dtype

    try:
        dtype = to_numpy_dtype(value)  # type: ignore[arg-type]  # anything: refused below when not a dtype
    except (TypeError, ValueError):
        dtype = None
    if dtype is None or dtype not in CAST_DTYPES:  # np.dtype(None) is float64: None first
        raise InvalidOptionError(f"{name}={value!r}: expected one of {_CAST_NAMES}")
    return dtype


def mesh(name: str, value: object) -> Mesh | None:
    """A ``jax.sharding.Mesh``; a spec such as ``"fsdp=2,tp=4"`` or a dict of axis sizes made one
    (:func:`otfload.make_mesh`); None (every device on ``fsdp``)."""
    from jax.sharding import Mesh

    from otfload.errors import OtfloadError
    from otfload.plan.sharding import make_mesh, parse_mesh_spec

    if value is None or isinstance(value, Mesh):
        return value
    expected = "a jax.sharding.Mesh, a spec such as 'fsdp=2,tp=4', a dict of axis sizes, or None"
    try:
        if isinstance(value, str):
            return make_mesh(parse_mesh_spec(value))
        if isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, int) for k, v in value.items()):
            return make_mesh(dict(value))
    except OtfloadError as e:
        raise InvalidOptionError(f"{name}={value!r}: {e}") from None
    raise InvalidOptionError(f"{name}={value!r}: expected {expected}")


__all__ = ["CAST_DTYPES", "cast_dtype", "count", "flag", "mesh", "one_of", "optional_flag", "seconds"]
