"""Where compiled programs are kept across jobs: JAX's persistent compilation cache, turned on.

A short eval job is dominated by compilation (seconds per scoring shape for a real model on an
accelerator, every run). JAX can keep each compiled executable on disk, keyed by the computation,
its shapes and shardings, the devices and the JAX/XLA versions, so a second job on the same model
and shapes loads the executable instead of compiling it; the eval jobs' scoring programs are kept
whole beside them, in ``DIR/otfload-programs`` (:mod:`otfload.programs`), so such a job does not
even trace and lower them. Jobs turn it on by default — the command line (``--compile-cache
DIR|off``) and lm_eval's construction of the ``otfload`` backend (``--model_args
compile_cache=DIR|off``) — in ``$OTFLOAD_COMPILE_CACHE``, else ``$XDG_CACHE_HOME/otfload/xla``
(``~/.cache/otfload/xla``); ``off`` leaves JAX's own setting alone. A default directory that cannot
be made (a read-only home) warns and the job compiles as usual; a directory asked for by name that
cannot be made is an error. Every executable is kept, however fast it compiled (JAX's default keeps
only those over a second, which would leave out the small shapes of a small model).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

from otfload.errors import InvalidOptionError
from otfload.options.environment import COMPILE_CACHE_ENV, environment

ENV_VAR = COMPILE_CACHE_ENV
OFF = "off"


def default_dir() -> Path:
    """``$OTFLOAD_COMPILE_CACHE``, else ``otfload/xla`` under the user's cache directory
    (:mod:`otfload.options.environment` reads both)."""
    env = environment()
    if env.compile_cache:
        return Path(env.compile_cache).expanduser()
    return (env.cache_home or Path.home() / ".cache") / "otfload" / "xla"


class CompileCacheWarning(UserWarning):
    """The default compilation-cache directory could not be made: the job compiles without it."""


def enable_compile_cache(setting: str | os.PathLike[str] | None) -> Path | None:
    """Turn the persistent cache on in ``setting`` (a directory; None: :func:`default_dir`);
    ``"off"`` does nothing. Returns the directory used (None when off, or when the default one
    cannot be made: a :class:`CompileCacheWarning`). Call before the first compilation.

    Raises ``InvalidOptionError`` when a directory given by name cannot be made."""
    if setting == OFF:
        return None
    path = default_dir() if setting is None else Path(setting).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        if setting is not None:
            raise InvalidOptionError(f"compile cache {str(path)!r}: cannot make the directory "
                                     f"({e.strerror or e})") from e
        warnings.warn(f"compiled programs are not kept: the compile cache {str(path)!r} cannot be made "
                      f"({e.strerror or e}); set ${ENV_VAR} to a writable directory", CompileCacheWarning,
                      stacklevel=2)
        return None
    import jax

    # jax's Config.update is unannotated
    jax.config.update("jax_compilation_cache_dir", str(path))  # type: ignore[no-untyped-call]
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # type: ignore[no-untyped-call]
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)  # type: ignore[no-untyped-call]
    return path
