"""Typed errors raised by otfload.

Every error a user can provoke with bad input derives from :class:`OtfloadError` and names the
file, key or leaf involved and what was expected. Catch ``OtfloadError`` to handle them all.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass


class OtfloadError(Exception):
    """Base class of every error otfload raises on purpose."""


# --- sources -------------------------------------------------------------------------------------


class SourceError(OtfloadError):
    """A checkpoint source cannot be opened or read."""


class SourceNotFoundError(SourceError):
    """The source (directory, repository, bucket prefix or file in it) does not exist."""


class SourceUnavailableError(SourceError):
    """The source exists but could not be reached within the retry bounds."""


class UnsafeFormatError(SourceError):
    """The checkpoint is stored in a format that would need unpickling (``.bin``, ``.pt``, ...)."""


# --- files and index -----------------------------------------------------------------------------


class CorruptFileError(OtfloadError):
    """A safetensors file is malformed; ``file`` names it and the message says what is wrong."""

    def __init__(self, file: str, reason: str):
        self.file = file
        self.reason = reason
        super().__init__(f"{file}: {reason}")


class TruncatedFileError(CorruptFileError):
    """A safetensors file is shorter than its header says."""


class HeaderError(CorruptFileError):
    """A safetensors header is not valid JSON of the expected form, or its offsets are wrong."""


class UnknownDtypeError(CorruptFileError):
    """A tensor's dtype string is not one otfload knows."""


class CheckpointIndexError(OtfloadError):
    """``model.safetensors.index.json`` or ``config.json`` is malformed or inconsistent."""


# --- models and plans ----------------------------------------------------------------------------


class UnsupportedModelError(OtfloadError):
    """``config.json`` names a ``model_type`` (or a feature of one) that otfload cannot build."""


class ConfigError(UnsupportedModelError):
    """A ``config.json`` field has the wrong type, is out of range, or contradicts the tensors present.

    ``field`` names the field (dotted for nested ones), ``value`` is what was found and ``rule`` what
    was expected.
    """

    def __init__(self, field: str, value: object, rule: str, file: str = "config.json"):
        self.field = field
        self.value = value
        self.rule = rule
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        super().__init__(f"{file}: {field} = {shown}: {rule}")


class QuantizationError(OtfloadError):
    """A quantized checkpoint cannot be decoded faithfully: an unknown ``quant_method``, a scale or
    companion tensor no format explains, or scales of the wrong shape. Raised whatever ``strict`` says,
    because loading such a checkpoint without its scales gives wrong weights."""


class UnsupportedQuantizationError(QuantizationError):
    """The checkpoint uses a known quantization method that otfload does not decode yet."""


class AdapterError(OtfloadError):
    """A PEFT adapter cannot be merged faithfully: a method or ``adapter_config.json`` field otfload
    does not merge (DoRA, ``fan_in_fan_out``, ...), a rank that disagrees with the tensors, A/B factors
    that do not fit the base module, or a module the base checkpoint or family does not have. The
    message names the adapter, the module and the field."""


class MappingError(OtfloadError):
    """A mapping table or hook is inconsistent with the model or checkpoint it is used on."""


class UnfaithfulCastError(MappingError):
    """A tensor's stored dtype cannot be held faithfully by its target leaf (integer or boolean data
    into a float leaf, FP8 codes without their scales) and the mapping does not say the cast is meant."""


@dataclass(frozen=True)
class TensorProblem:
    """One missing, unexpected or mis-shaped tensor found while planning a load."""

    kind: str  # "missing" | "unexpected" | "shape" | "unmapped" (no rule; ``actual`` = nearest rules)
    hf_key: str | None
    leaf: str | None
    expected: object = None
    actual: object = None
    file: str | None = None

    def describe(self) -> str:
        where = f" in {self.file}" if self.file else ""
        if self.kind == "missing":
            return f"missing tensor {self.hf_key!r} needed by leaf {self.leaf!r} (expected shape {self.expected})"
        if self.kind == "unmapped":
            rules = self.actual if isinstance(self.actual, (list, tuple)) else ()
            nearest = ", ".join(repr(r) for r in rules) or "none alike"
            return f"no mapping rule matches leaf {self.leaf!r} (shape {self.expected}); nearest rules: {nearest}"
        if self.kind == "unexpected":
            return f"unexpected tensor {self.hf_key!r}{where} (shape {self.actual}) is used by no leaf"
        return (
            f"shape mismatch for leaf {self.leaf!r} from {self.hf_key!r}{where}: "
            f"expected {self.expected}, got {self.actual}"
        )


class CheckpointMismatchError(OtfloadError):
    """The checkpoint's tensors do not fit the target tree; every problem is listed at once."""

    def __init__(self, problems: Sequence[TensorProblem]):
        self.problems = list(problems)
        lines = [p.describe() for p in self.problems]
        shown = lines[:50] + ([f"... and {len(lines) - 50} more"] if len(lines) > 50 else [])
        super().__init__(f"{len(lines)} problem(s) loading checkpoint:\n  " + "\n  ".join(shown))

    @property
    def missing(self) -> list[TensorProblem]:
        return [p for p in self.problems if p.kind == "missing"]

    @property
    def unexpected(self) -> list[TensorProblem]:
        return [p for p in self.problems if p.kind == "unexpected"]

    @property
    def mismatched(self) -> list[TensorProblem]:
        return [p for p in self.problems if p.kind == "shape"]

    @property
    def unmapped(self) -> list[TensorProblem]:
        return [p for p in self.problems if p.kind == "unmapped"]


class MissingTensorError(CheckpointMismatchError):
    """Raised when every problem found is a missing tensor."""


class UnexpectedTensorError(CheckpointMismatchError):
    """Raised when every problem found is a tensor no leaf uses (only with ``strict=True``)."""


class ShapeMismatchError(CheckpointMismatchError):
    """Raised when every problem found is a tensor of the wrong shape."""


class UnmappedLeafError(CheckpointMismatchError):
    """Raised when every problem found is a target leaf that no rule of the mapping table matches;
    each problem names the leaf and the nearest rules."""


class MeshRequiredError(MappingError):
    """A target leaf's sharding is on an abstract mesh, or is only names (or absent), and no concrete
    ``mesh=`` was given to make it real."""


class IndivisibleShardingError(MappingError):
    """A target leaf's sharding splits a dimension over mesh axes whose size does not divide it.

    ``leaf``, ``axis`` (the dimension), ``size`` (its length), ``mesh_axes`` and ``mesh_size`` (their
    product) say which."""

    def __init__(self, leaf: str, axis: int, size: int, mesh_axes: Sequence[str], mesh_size: int):
        self.leaf, self.axis, self.size = leaf, axis, size
        self.mesh_axes, self.mesh_size = tuple(mesh_axes), mesh_size
        super().__init__(
            f"leaf {leaf!r}: dimension {axis} of size {size} is sharded over mesh axes {self.mesh_axes} "
            f"of {mesh_size} devices, which does not divide it"
        )


def mismatch_error(problems: Sequence[TensorProblem]) -> CheckpointMismatchError:
    """The most specific :class:`CheckpointMismatchError` subclass for ``problems``."""
    kinds = {p.kind for p in problems}
    cls = {
        frozenset({"missing"}): MissingTensorError,
        frozenset({"unexpected"}): UnexpectedTensorError,
        frozenset({"shape"}): ShapeMismatchError,
        frozenset({"unmapped"}): UnmappedLeafError,
    }.get(frozenset(kinds), CheckpointMismatchError)
    return cls(problems)


# --- native checkpoints --------------------------------------------------------------------------


class NativeCheckpointError(OtfloadError):
    """A native (otfload/Orbax) checkpoint cannot be saved or restored."""


class OutputExistsError(OtfloadError, FileExistsError):
    """An export or reshard target already exists and ``overwrite`` was not asked for."""


class ScanLayersMismatchError(NativeCheckpointError):
    """The caller asked for a ``scan_layers`` value that conflicts with the checkpoint's metadata."""


class LayerLayoutError(OtfloadError):
    """A parameter tree cannot be converted between the scanned and unscanned layer layouts."""


# --- remote sources ------------------------------------------------------------------------------


class SourceTimeoutError(SourceUnavailableError):
    """A read made no progress for too long, or the load's total deadline passed.

    ``url`` names what was being read and ``received`` how many bytes of it had arrived.
    """

    def __init__(self, message: str, url: str = "", received: int = 0):
        self.url = url
        self.received = received
        super().__init__(message)


class LoadCancelled(OtfloadError):
    """This read was abandoned because another part of the same load failed for good first.

    The loader raises that first failure, never this; it only reaches callers that cancel on purpose.
    """


class SourceProtocolError(SourceError):
    """A server answered in a way that cannot be trusted: a ``Content-Range`` for other bytes, a body
    shorter or longer than asked, a broken ``Content-Encoding``, a redirect loop, or metadata that is
    not the JSON it should be."""


class SourcePermissionError(SourceError):
    """The source refused the credentials (missing, invalid, or without access); never shows the token."""


class ChecksumMismatchError(SourceError):
    """A downloaded file's sha256 differs from the one the source published; the copy was discarded."""


# --- shard cache ---------------------------------------------------------------------------------


class CacheError(SourceError):
    """The shard cache could not be filled or read."""


class CacheUnsafeNameError(CacheError):
    """A file name that would place a cache entry outside the cache root (``..``, absolute, NUL, a
    symlink leaving the root); nothing was written."""


class CacheStorageError(CacheError):
    """The cache location cannot be used: it is read-only, full (no space, over quota or over the
    file-size limit), or a file stands where a folder should be. ``path`` names it and ``errno`` is
    the operating system's reason (``errno.ENOSPC``, ``errno.EROFS``, ...)."""

    def __init__(self, message: str, path: str, errno_: int | None):
        self.path = path
        self.errno = errno_
        super().__init__(message)


class CacheIntegrityError(CacheError):
    """A cache entry's bytes do not match the size and hash recorded when it was filled."""


class CacheFillError(CacheError):
    """A process could not fetch a file into the shard cache; ``process`` and ``file`` name it."""

    def __init__(self, message: str, process: int, file: str):
        self.process = process
        self.file = file
        super().__init__(message)


class CacheTimeoutError(CacheFillError):
    """A process waited too long for another one to commit a file to the shard cache.

    ``process`` is the process that fills ``file`` (the one waited for); ``waiter`` the one that gave up.
    """

    def __init__(self, message: str, process: int, file: str, waiter: int):
        self.waiter = waiter
        super().__init__(message, process, file)


# --- collectives of a multi-process load -----------------------------------------------------------


class CollectiveError(OtfloadError):
    """The processes of a multi-process load did not all join a collective (the agreement on read
    layouts, or a reshard): the load ends on every process instead of waiting forever. ``leaf`` names
    the leaf of the collective (None: the agreement before any leaf), ``processes`` the processes
    that disagreed or did not arrive."""

    def __init__(self, message: str, leaf: str | None = None, processes: Sequence[int] = ()):
        self.leaf = leaf
        self.processes = list(processes)
        super().__init__(message)


class CollectiveMismatchError(CollectiveError):
    """The processes would run different collectives (another plan, policy or list of resharded leaves)."""


class CollectiveTimeoutError(CollectiveError):
    """A process did not reach a collective, or the collective did not complete, within the bound
    (``OTFLOAD_COLLECTIVE_TIMEOUT``)."""


# --- options -------------------------------------------------------------------------------------


class InvalidOptionError(OtfloadError, ValueError):
    """A keyword argument, CLI flag or ``OTFLOAD_*`` environment variable has a value otfload does
    not accept; the message names the option, the value and the accepted ones."""


class DeviceCountError(InvalidOptionError):
    """A mesh's axis sizes multiply to another number of devices than JAX has. ``sizes`` is the mesh
    asked for, ``needed`` the devices it takes and ``available`` how many there are."""

    def __init__(self, sizes: dict[str, int], available: int):
        self.sizes = dict(sizes)
        self.needed = math.prod(sizes.values())
        self.available = available
        super().__init__(
            f"mesh {self.sizes} needs {self.needed} devices, but {available} are available: choose axis sizes "
            f"whose product is {available}, or simulate {self.needed} CPU devices with "
            f"XLA_FLAGS=--xla_force_host_platform_device_count={self.needed} (set before JAX starts)"
        )


# --- evaluation ----------------------------------------------------------------------------------


class TokenizerError(OtfloadError):
    """The checkpoint's ``tokenizer.json`` cannot be loaded, or gives ids the model cannot take."""


class TokenizerNotFoundError(TokenizerError, SourceNotFoundError):
    """The source has no ``tokenizer.json`` (only the fast-tokenizer file is supported)."""


class EvalDataError(OtfloadError):
    """An evaluation data file is not what its format says (names the file, line and field)."""


class EvalRequestError(OtfloadError):
    """An lm-evaluation-harness request the ``otfload`` backend cannot honour as asked (sampling,
    a continuation longer than the context window, an empty continuation); names the request."""
