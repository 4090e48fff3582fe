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
  shape, dtype, weak type and sharding (mesh, spec and device ids), the static arguments' values
  (keywords the function is specialised on: a mesh by its axes and device ids, anything else by
  its ``repr``), the donated arguments, the jit's output shardings and the mesh the call runs
  under (``jax.set_mesh``);
* the Python, JAX, jaxlib, Flax and NumPy versions, every ``jax.config`` value, ``XLA_FLAGS``, the
  process index and count, the backend (platform, version, every device's id and kind) and, on CPU,
  the host's instruction-set flags (an executable compiled for one CPU must not run on another).

A second job computes the key, reads the entry and loads the executable: no tracing, lowering or
XLA compilation. Within a process each program is also remembered by the arguments' tree, each
leaf's shape, dtype, weak type and sharding, the static values and JAX's tracing context (what
``jax.jit``'s own cache looks at), so a program called once per step, like a decoding step, is
keyed and read once, and each later :meth:`CachedJit.compile` costs a dictionary look-up.

An entry is written whole or not at all (a temporary file renamed into place) and
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
from collections.abc import Callable, Hashable, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import flax
import jax
import numpy as np
from jax._src import config as jax_config  # trace_context: what jax.jit's own cache keys by
from jax.experimental import serialize_executable
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from otfload.atomic import temp_path

log = logging.getLogger(__name__)

DIR_NAME = "otfload-programs"  # inside XLA's cache directory (JAX's own entries are files named *-cache)
FORMAT = 1  # of an entry; part of the key, so a new layout never reads an old one
ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")  # how a default repr names an object: differs every process
DIGEST_BYTES = 32  # the SHA-256 of the payload that starts each entry
TOKEN_CHARS = 16  # of the random suffix of compiled modules' names (apart whoever compiles)


class Program(NamedTuple):
    """A compiled program, the seconds :meth:`CachedJit.compile` took to get it (key, cache read,
    or tracing, lowering and XLA; 0 when this process had it already) and, of those, tracing and
    lowering (0 when it came from the cache)."""

    compiled: jax.stages.Compiled
    seconds: float
    lower_seconds: float


class CachedJit:
    """``jax.jit(fn, static_argnames=..., donate_argnums=..., out_shardings=...)`` whose compiled
    programs are kept across processes.

    ``fn`` must be a function without a closure (the key names it, it does not read captured
    values). :meth:`compile` takes the positional arguments as ``jax.jit(fn).lower`` does (arrays
    or ``jax.ShapeDtypeStruct`` leaves, shardings included) and the static ones, ``static_argnames``,
    as keywords (hashable values the program is specialised on); the compiled program takes the
    positional ones alone. ``donate_argnums``: the positional arguments whose buffers the program
    may reuse for its outputs (a call deletes the caller's arrays there)."""

    def __init__(self, fn: Callable[..., Any], *, static_argnames: Sequence[str] = (),
                 donate_argnums: Sequence[int] = (), out_shardings: Any = None) -> None:
        if getattr(fn, "__closure__", None) or not hasattr(fn, "__qualname__"):
            raise ValueError(f"{fn!r}: a program kept across jobs is a plain function (a closure's values "
                             "would not be in its key)")
        self.fn, self.out_shardings = fn, out_shardings
        self.static_argnames, self.donate_argnums = frozenset(static_argnames), tuple(donate_argnums)
        self._programs: dict[Hashable, jax.stages.Compiled] = {}  # this process's, by _signature

    def compile(self, *args: Any, **static: Any) -> Program:
        """The program for ``args`` and the static values: this process's when it has it (0
        seconds), else from the cache when an entry is there, else traced, lowered and compiled
        (and kept when a cache directory is set)."""
        signature = _signature(args, static)
        compiled = self._programs.get(signature)
        if compiled is not None:
            return Program(compiled, 0.0, 0.0)
        program = self._get(args, static)
        self._programs[signature] = program.compiled
        return program

    def _get(self, args: tuple[Any, ...], static: dict[str, Any]) -> Program:
        """The program from the cache, else compiled (and kept when a cache directory is set)."""
        start = time.perf_counter()
        if static.keys() != self.static_argnames:
            raise TypeError(f"{self.fn.__qualname__}: static arguments {sorted(static)} given; "
                            f"expected {sorted(self.static_argnames)}")
        directory = programs_dir()
        key = None if directory is None else self.key(*args, **static)
        if directory is None or key is None:
            return self._compile(_named(self.fn, self.fn.__name__, static), args, None, start)
        path = directory / f"{self.fn.__name__}-{key}"
        compiled = _load(path, *jax.tree.flatten((args, {})))
        if compiled is not None:
            return Program(compiled, time.perf_counter() - start, 0.0)
        # A name of its own: XLA's cache, which this compilation writes to as well, never returns it.
        named = _named(self.fn, f"{self.fn.__name__}_{uuid.uuid4().hex[:TOKEN_CHARS]}", static)
        return self._compile(named, args, path, start)

    def _compile(self, fn: Callable[..., Any], args: tuple[Any, ...], path: Path | None, start: float) -> Program:
        """Trace, lower and compile ``fn`` for ``args``; keep the program at ``path`` when given.
        ``start``: when :meth:`compile` was called."""
        options: dict[str, Any] = {"donate_argnums": self.donate_argnums}
        if self.out_shardings is not None:
            options["out_shardings"] = self.out_shardings
        lower_start = time.perf_counter()
        lowered = jax.jit(fn, **options).lower(*args)
        lower_seconds = time.perf_counter() - lower_start
        compiled = lowered.compile()
        if path is not None:
            _save(path, compiled)
        return Program(compiled, time.perf_counter() - start, lower_seconds)

    def key(self, *args: Any, **static: Any) -> str | None:
        """The key of the program for ``args`` and the static values (hex SHA-256); None when it
        is not kept: a leaf is not an array on this process's devices, or the description names an
        object by its address (a new key in every process)."""
        leaves, tree = jax.tree.flatten((args, {}))
        if not all(_keepable(leaf) for leaf in leaves):
            return None
        out_shardings = [_sharding_key(s) for s in jax.tree.leaves(self.out_shardings)]
        statics = [(name, _static_key(static[name])) for name in sorted(static)]
        ambient = (repr(jax.sharding.get_abstract_mesh()), _mesh_key(jax.sharding.get_mesh()))
        description = repr([FORMAT, self.fn.__module__, self.fn.__qualname__, sources_digest(), environment_key(),
                            repr(tree), [_leaf_key(leaf) for leaf in leaves], statics, self.donate_argnums,
                            out_shardings, ambient])
        return None if ADDRESS.search(description) else hashlib.sha256(description.encode()).hexdigest()


def _signature(args: tuple[Any, ...], static: dict[str, Any]) -> Hashable:
    """What tells this process's programs apart (as ``jax.jit``'s cache does): the arguments' tree,
    each leaf's shape, dtype, weak type and sharding, the static values, JAX's tracing context
    (its configuration and abstract mesh) and the mesh the call runs under."""
    leaves, tree = jax.tree.flatten(args)
    avals = tuple((getattr(leaf, "shape", None), getattr(leaf, "dtype", type(leaf)),
                   getattr(leaf, "weak_type", False), getattr(leaf, "sharding", None)) for leaf in leaves)
    return tree, avals, frozenset(static.items()), jax_config.trace_context(), jax.sharding.get_mesh()


def _named(fn: Callable[..., Any], name: str, static: dict[str, Any]) -> Callable[..., Any]:
    """``fn`` with the static values bound, under ``name``: the name of the module XLA compiles,
    which XLA's cache key hashes."""

    def program(*args: Any) -> Any:
        return fn(*args, **static)

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
        return repr(sharding), _mesh_key(sharding.mesh)[1]
    return repr(sharding), tuple(sorted(d.id for d in sharding.device_set))


def _mesh_key(mesh: Mesh | AbstractMesh) -> tuple[str, tuple[int, ...]]:
    """A mesh's description (axes, sizes, types) and its devices in order (none for an abstract or
    empty mesh: no ``jax.set_mesh``)."""
    ids = np.asarray(mesh.device_ids).flat if isinstance(mesh, Mesh) and not mesh.empty else ()
    return repr(mesh), tuple(int(i) for i in ids)


def _static_key(value: Any) -> Any:
    """A static argument's value in a key: a mesh by its axes and devices, anything else by its ``repr``."""
    return _mesh_key(value) if isinstance(value, Mesh | AbstractMesh) else repr(value)


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
    tmp = temp_path(path)
    try:
        tmp.write_bytes(hashlib.sha256(payload).digest() + payload)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("compiled program %s not kept: %s", path, e)
        tmp.unlink(missing_ok=True)
