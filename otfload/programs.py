"""Compiled programs kept across jobs: a second job with the same program skips tracing, lowering and XLA.

XLA's persistent compilation cache (``jax_compilation_cache_dir``, the CLI's ``--compile-cache``)
finds an executable by a hash of its lowered StableHLO, so a job whose executables are all there
still traces each Python function and lowers it before it can look: every job, for each of an eval
job's scoring shapes (on CPU about 0.2 s per shape of a small model, a fifth of the first job's
compile time). :class:`CachedJit` keeps the compiled executable itself
(``jax.experimental.serialize_executable``) in ``otfload-programs/`` inside XLA's cache directory,
under a key of everything that shapes the program before it is lowered:

* the function (module and qualified name) and a digest of otfload's sources (every ``.py`` file of
  the package: a change to any code the function can reach gives a new key);
* the arguments' tree (an NNX module's structure and static fields: its config) and each leaf's
  shape, dtype, weak type and sharding (mesh, spec and device ids), and the jit's output shardings;
* the Python, JAX, jaxlib, Flax and NumPy versions, every ``jax.config`` value, ``XLA_FLAGS``, the
  process index and count, the backend (platform, version, every device's id and kind) and, on CPU,
  the host's instruction-set flags (an executable compiled for one CPU must not run on another).

A second job computes the key, reads the entry and loads the executable: no tracing, lowering or
XLA compilation. An entry is written whole or not at all (a temporary file renamed into place) and
holds a SHA-256 of its payload; one that fails its checksum, does not load, or records argument
shapes other than the call's is compiled afresh and rewritten, with a warning: a bad entry costs a
compilation, never a wrong program. The module compiled to be kept has a name of its own (the
function's and a random token), so XLA's persistent cache, which that compilation writes to as
usual (an entry no later job reads), never hands it back: an executable loaded from XLA's cache
does not serialize whole (XLA:CPU's re-serialization drops its functions; the program fails when
run). Programs over devices of other processes, programs whose description names an object by its
address (a new key every process), and programs that cannot be serialized (constants passed as
arguments) are compiled as usual and not kept. Nothing is evicted: a changed source or setting
makes new entries beside the old ones. As with XLA's cache, the directory is trusted: loading an
entry runs its code.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import logging
import os
import pickle
import platform
import re
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import flax
import jax
import numpy as np
from jax.experimental import serialize_executable
from jax.sharding import NamedSharding

log = logging.getLogger(__name__)

DIR_NAME = "otfload-programs"  # inside XLA's cache directory (JAX's own entries are files named *-cache)
FORMAT = 1  # of an entry; part of the key, so a new layout never reads an old one
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # how a default repr names an object: differs every process
DIGEST_BYTES = 32  # the SHA-256 of the payload that starts each entry
TOKEN_CHARS = 16  # of the random suffixes of temporary files and compiled modules' names (apart whoever writes)


class Program(NamedTuple):
    """A compiled program, the seconds :meth:`CachedJit.compile` took to get it (key, cache read,
    or tracing, lowering and XLA) and, of those, tracing and lowering (0 when it came from the
    cache)."""

    compiled: jax.stages.Compiled
    seconds: float
    lower_seconds: float


class CachedJit:
    """``jax.jit(fn, out_shardings=...)`` whose compiled programs are kept across processes.

    ``fn`` must be a function without a closure (the key names it, it does not read captured
    values); :meth:`compile` takes arguments as ``jax.jit(fn).lower`` does (arrays or
    ``jax.ShapeDtypeStruct`` leaves, shardings included)."""

    def __init__(self, fn: Callable[..., Any], *, out_shardings: Any = None) -> None:
        if getattr(fn, "__closure__", None) or not hasattr(fn, "__qualname__"):
            raise ValueError(f"{fn!r}: a program kept across jobs is a plain function (a closure's values "
                             "would not be in its key)")
        self.fn, self.out_shardings = fn, out_shardings

    def compile(self, *args: Any) -> Program:
        """The program for ``args``: from the cache when an entry is there, else traced, lowered
        and compiled (and kept when a cache directory is set)."""
        start = time.perf_counter()
        directory = programs_dir()
        key = None if directory is None else self.key(*args)
        if directory is None or key is None:
            return self._compile(self.fn, args, None, start)
        path = directory / f"{self.fn.__name__}-{key}"
        compiled = _load(path, *jax.tree.flatten((args, {})))
        if compiled is not None:
            return Program(compiled, time.perf_counter() - start, 0.0)
        # A name of its own: XLA's cache, which this compilation writes to as well, never returns it.
        named = _named(self.fn, f"{self.fn.__name__}_{uuid.uuid4().hex[:TOKEN_CHARS]}")
        return self._compile(named, args, path, start)

    def _compile(self, fn: Callable[..., Any], args: tuple[Any, ...], path: Path | None, start: float) -> Program:
        """Trace, lower and compile ``fn`` for ``args``; keep the program at ``path`` when given.
        ``start``: when :meth:`compile` was called."""
        jitted = jax.jit(fn) if self.out_shardings is None else jax.jit(fn, out_shardings=self.out_shardings)
        lower_start = time.perf_counter()
        lowered = jitted.lower(*args)
        lower_seconds = time.perf_counter() - lower_start
        compiled = lowered.compile()
        if path is not None:
            _save(path, compiled)
        return Program(compiled, time.perf_counter() - start, lower_seconds)

    def key(self, *args: Any) -> str | None:
        """The key of the program for ``args`` (hex SHA-256); None when it is not kept: a leaf is
        not an array on this process's devices, or the description names an object by its address
        (a new key in every process)."""
        leaves, tree = jax.tree.flatten((args, {}))
        if not all(_keepable(leaf) for leaf in leaves):
            return None
        out_shardings = [_sharding_key(s) for s in jax.tree.leaves(self.out_shardings)]
        description = repr([FORMAT, self.fn.__module__, self.fn.__qualname__, sources_digest(), environment_key(),
                            repr(tree), [_leaf_key(leaf) for leaf in leaves], out_shardings])
        return None if ADDRESS.search(description) else hashlib.sha256(description.encode()).hexdigest()


def _named(fn: Callable[..., Any], name: str) -> Callable[..., Any]:
    """``fn`` under ``name``: the name of the module XLA compiles, which XLA's cache key hashes."""

    def program(*args: Any) -> Any:
        return fn(*args)

    program.__name__ = program.__qualname__ = name
    return program


def programs_dir() -> Path | None:
    """``otfload-programs`` in JAX's compilation cache directory; None when none is set (or it is
    not a local path)."""
    setting = jax.config.jax_compilation_cache_dir  # type: ignore[attr-defined]  # jax's Config is dynamic
    if not setting or "://" in str(setting):
        return None
    return Path(setting) / DIR_NAME


@functools.cache
def sources_digest() -> str:
    """SHA-256 of every ``.py`` file of the otfload package (relative path and contents)."""
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def environment_key() -> str:
    """What shapes a program besides its function and arguments: versions, JAX's configuration,
    XLA's flags, the processes, the backend and its devices, the host CPU."""
    devices = [(d.id, d.device_kind, d.process_index) for d in jax.devices()]
    backend = jax.devices()[0].client
    config = sorted((k, repr(v)) for k, v in jax.config.values.items())
    return repr([_versions(), config, os.environ.get("XLA_FLAGS", ""), jax.process_index(), jax.process_count(),
                 backend.platform, backend.platform_version, devices,
                 _cpu_flags() if backend.platform == "cpu" else ""])


@functools.cache
def _versions() -> tuple[str, ...]:
    return sys.version, jax.__version__, importlib.metadata.version("jaxlib"), flax.__version__, np.__version__


@functools.cache
def _cpu_flags() -> str:
    """The host's machine type and instruction-set flags (Linux's ``/proc/cpuinfo``)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        flags = platform.processor()
    return f"{platform.machine()} {flags.strip()}"


def _leaf_key(leaf: Any) -> tuple[Any, ...]:
    sharding = getattr(leaf, "sharding", None)
    return (tuple(leaf.shape), str(leaf.dtype), bool(getattr(leaf, "weak_type", False)),
            None if sharding is None else _sharding_key(sharding))


def _sharding_key(sharding: Any) -> tuple[str, tuple[int, ...]]:
    """A sharding's description with its devices in order (a ``NamedSharding``'s repr names its
    mesh's axes, not which devices they hold)."""
    if isinstance(sharding, NamedSharding):
        return repr(sharding), tuple(int(i) for i in np.asarray(sharding.mesh.device_ids).flat)
    return repr(sharding), tuple(sorted(d.id for d in sharding.device_set))


def _keepable(leaf: Any) -> bool:
    """An array (or its ``ShapeDtypeStruct``) on this process's devices: its program can be kept."""
    sharding = getattr(leaf, "sharding", None)
    on_this_process = sharding is None or bool(sharding.is_fully_addressable)
    return hasattr(leaf, "shape") and hasattr(leaf, "dtype") and on_this_process


def _load(path: Path, leaves: list[Any], tree: Any) -> jax.stages.Compiled | None:
    """The program of the entry at ``path``; None when there is none or it is unusable."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as e:
        log.warning("compiled program %s unreadable (%s); compiling afresh", path, e)
        return None
    payload = data[DIGEST_BYTES:]
    if hashlib.sha256(payload).digest() != data[:DIGEST_BYTES]:
        log.warning("compiled program %s fails its checksum; compiling afresh", path)
        return None
    try:
        executable, out_tree = pickle.loads(payload)
        compiled: jax.stages.Compiled = serialize_executable.deserialize_and_load(executable, tree, out_tree)
        recorded = [(tuple(info.shape), str(info.dtype)) for info in jax.tree.leaves(compiled.args_info)]
    except Exception as e:  # whatever a bad entry raises on loading: it is compiled afresh instead
        log.warning("compiled program %s does not load (%s: %s); compiling afresh", path, type(e).__name__, e)
        return None
    if recorded != [(tuple(leaf.shape), str(leaf.dtype)) for leaf in leaves]:
        log.warning("compiled program %s takes other arguments than this call's; compiling afresh", path)
        return None
    return compiled


def _save(path: Path, compiled: jax.stages.Compiled) -> None:
    """Write ``compiled`` to ``path`` whole or not at all; a program that cannot be serialized is not kept."""
    try:
        executable, _, out_tree = serialize_executable.serialize(compiled)
        payload = pickle.dumps((executable, out_tree))
    except Exception as e:  # constants passed as arguments, trees that do not pickle: not kept
        log.debug("compiled program %s not kept: %s: %s", path.name, type(e).__name__, e)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:TOKEN_CHARS]}")
    try:
        tmp.write_bytes(hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("compiled program %s not kept: %s", path, e)
        tmp.unlink(missing_ok=True)
