"""The ``OTFLOAD_*`` environment variables, read and checked in one place.

:func:`environment` reads them when a load resolves its options (:func:`otfload.options.resolve_options`)
and fills the :class:`~otfload.options.LoadOptions` fields left unset; what lies below the front door
gets the values as arguments and reads no environment (``tests/test_architecture.py`` checks it). A
bad value is an :class:`~otfload.errors.InvalidOptionError` naming the variable.

=============================  ===================================  ==============================
variable                       field                                values
=============================  ===================================  ==============================
``OTFLOAD_TIMEOUT``            ``timeout``                          seconds > 0
``OTFLOAD_RESHARD``            ``reshard``                          auto, always, never
``OTFLOAD_DEVICE_HOOKS``       ``device_hooks``                     auto, always, never
``OTFLOAD_READ_AHEAD``         ``read_ahead``                       1, 0
``OTFLOAD_DIRECT_IO``          ``direct_io``                        1, 0
``OTFLOAD_HOST_RING_BYTES``    ``host_ring_bytes``                  bytes >= 0
``OTFLOAD_COLLECTIVE_TIMEOUT`` ``collective_timeout``               seconds > 0
``OTFLOAD_CACHE``              ``shard_cache=True``'s directory     a path
``XDG_CACHE_HOME``             under it, both caches' defaults      a path
``OTFLOAD_COMPILE_CACHE``      jobs' compiled programs              a path, or ``off``
=============================  ===================================  ==============================
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path

from otfload.coordination.agreement import TIMEOUT_ENV as COLLECTIVE_TIMEOUT_ENV
from otfload.errors import InvalidOptionError
from otfload.options import checks
from otfload.place.collective_route import POLICIES as RESHARD_POLICIES
from otfload.place.collective_route import RESHARD_ENV
from otfload.place.device_hooks import DEVICE_HOOKS_ENV
from otfload.place.device_hooks import POLICIES as DEVICE_HOOK_POLICIES
from otfload.read.pinned import HOST_RING_ENV
from otfload.read.readahead import READ_AHEAD_ENV
from otfload.read.reader import DIRECT_IO_ENV
from otfload.sources.retry import TIMEOUT_ENV

COMPILE_CACHE_ENV = "OTFLOAD_COMPILE_CACHE"  # read by otfload.compile_cache (a job's compiled programs)
# The variable of each LoadOptions field the environment sets.
VARIABLES = {"timeout": TIMEOUT_ENV, "reshard": RESHARD_ENV, "device_hooks": DEVICE_HOOKS_ENV,
             "read_ahead": READ_AHEAD_ENV, "direct_io": DIRECT_IO_ENV, "host_ring_bytes": HOST_RING_ENV,
             "collective_timeout": COLLECTIVE_TIMEOUT_ENV}

FLAGS = {"1": True, "0": False}


@dataclass(frozen=True)
class Environment:
    """The settings the environment gives; None where a variable is unset (the option's own default)."""

    timeout: float | None = None
    reshard: str | None = None
    device_hooks: str | None = None
    read_ahead: bool | None = None
    direct_io: bool | None = None
    host_ring_bytes: int | None = None
    collective_timeout: float | None = None
    cache_dir: Path | None = None
    cache_home: Path | None = None
    compile_cache: str | None = None

    @property
    def local_cache_dir(self) -> Path:
        """Where ``shard_cache=True`` keeps whole files of a source that keeps none itself:
        ``$OTFLOAD_CACHE``, else ``$XDG_CACHE_HOME/otfload`` (``~/.cache/otfload``)."""
        return self.cache_dir or (self.cache_home or Path("~/.cache").expanduser()) / "otfload"


def environment(environ: Mapping[str, str] | None = None, *, given: Collection[str] = ()) -> Environment:
    """The ``OTFLOAD_*`` settings of ``environ`` (default ``os.environ``), each checked; the variables
    of the fields in ``given`` (set by the caller, who wins) are neither read nor checked."""
    env = os.environ if environ is None else environ
    skipped = {VARIABLES[field] for field in given if field in VARIABLES}

    def text(name: str) -> str | None:
        return None if name in skipped else (env.get(name) or "").strip() or None

    def seconds(name: str) -> float | None:
        if (raw := text(name)) is None:
            return None
        try:
            return checks.seconds(f"${name}", float(raw))
        except (ValueError, InvalidOptionError):
            raise InvalidOptionError(f"${name}={raw!r}: expected a number of seconds > 0") from None

    def nbytes(name: str) -> int | None:
        if (raw := text(name)) is None:
            return None
        if not raw.isdigit():
            raise InvalidOptionError(f"${name}={raw!r}: expected a number of bytes >= 0")
        return int(raw)

    def choice(name: str, allowed: tuple[str, ...]) -> str | None:
        raw = text(name)
        return None if raw is None else checks.one_of(f"${name}", raw, allowed)

    def switch(name: str) -> bool | None:
        raw = text(name)
        return None if raw is None else FLAGS[checks.one_of(f"${name}", raw, tuple(FLAGS))]

    def path(name: str) -> Path | None:
        raw = text(name)
        return None if raw is None else Path(raw).expanduser()

    return Environment(
        timeout=seconds(TIMEOUT_ENV),
        reshard=choice(RESHARD_ENV, RESHARD_POLICIES),
        device_hooks=choice(DEVICE_HOOKS_ENV, DEVICE_HOOK_POLICIES),
        read_ahead=switch(READ_AHEAD_ENV),
        direct_io=switch(DIRECT_IO_ENV),
        host_ring_bytes=nbytes(HOST_RING_ENV),
        collective_timeout=seconds(COLLECTIVE_TIMEOUT_ENV),
        cache_dir=path("OTFLOAD_CACHE"),
        cache_home=path("XDG_CACHE_HOME"),
        compile_cache=text(COMPILE_CACHE_ENV),
    )


__all__ = ["COMPILE_CACHE_ENV", "VARIABLES", "Environment", "environment"]
