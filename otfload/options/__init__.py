"""What a load is asked to do, as one object: :class:`LoadOptions`.

Every entry point (``from_pretrained``, ``load_params``, ``plan_model``, ``plan_params``, the training
and evaluation helpers, the lm-evaluation-harness backend) takes ``options=`` and, as the friendly
surface, the same fields one by one as keyword arguments; :func:`resolve_options` merges the two. The
command line builds one object from its flags (``otfload.cli.options.load_options``).

A :class:`LoadOptions` checks its values when it is made, so a bad ``quantized``, ``reshard`` or
``verify`` fails before any source is opened. The keyword arguments are typed by
:class:`LoadKeywords` (``from_pretrained``, ``plan_model``) and :class:`ParamsKeywords`
(``load_params``, ``plan_params``: a tree you bring fixes its own layout and dtypes, so
``scan_layers`` and ``dtype`` are not among them); ``tests/test_options.py`` keeps the three lists equal.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypedDict

from otfload.cache import VERIFY_MODES
from otfload.errors import AdapterError, InvalidOptionError
from otfload.options import checks
from otfload.options.environment import VARIABLES, Environment, environment
from otfload.place.collective_route import POLICIES as RESHARD_POLICIES
from otfload.place.device_hooks import POLICIES as DEVICE_HOOK_POLICIES
from otfload.plan.keep import check_quantized_mode
from otfload.sources import Source
from otfload.sources.retry import RetryPolicy

if TYPE_CHECKING:
    from jax.sharding import Mesh

    from otfload.adapters.load import AdapterSpec
    from otfload.plan.sharding import LogicalRules

ShardCacheSpec = str | os.PathLike[str] | bool | None
SOURCE_FIELDS = ("revision", "token", "endpoint", "cache_dir", "local_files_only", "storage_options", "retry",
                 "timeout", "mmap")  # what ``otfload.sources.open_source`` takes
MODEL_FIELDS = ("scan_layers", "dtype")  # the bundled model's layout: not for a tree you bring


@dataclass(frozen=True)
class LoadOptions:
    """Every option of a load, in one frozen object, checked when it is made.

    Planning reads no tensor, so ``plan_model`` and ``plan_params`` leave the options of the reads
    (``workers``, ``host_memory_budget``, ``progress``, ``reshard``) unused; a tree you bring
    (``load_params``, ``plan_params``) fixes its own ``scan_layers`` and ``dtype``.

    Parameters
    ----------
    revision, token, endpoint, cache_dir, local_files_only
        Options of a Hub source: branch, tag or commit; token (default: the ``huggingface_hub``
        login); endpoint (default ``$HF_ENDPOINT``); the HF cache directory; no network
        (``$HF_HUB_OFFLINE`` too).
    storage_options
        fsspec ``storage_options`` of a URL source (``gs://``, ``s3://``, ...).
    retry
        The ``RetryPolicy`` of a remote source.
    timeout
        The load's total deadline in seconds, from opening the source to the last byte (default
        ``$OTFLOAD_TIMEOUT``, else none); past it a read raises ``SourceTimeoutError``.
    mmap
        Read a local directory through read-only mappings (``False``: ``preadv``).
    shard_cache
        A directory shared by the processes, or a ``gs://`` prefix (``True``: a single-host local
        cache): each file is fetched once cluster-wide into it, and ranges are read from there.
    shard_cache_options
        fsspec ``storage_options`` of the ``shard_cache`` location (credentials, project).
    verify
        The shard cache's integrity check of the copies it reuses: ``"record"`` (size and the hash
        recorded when the copy was filled, re-hashed only when the file changed on disk) or
        ``"full"`` (re-hashed on every load); a copy that fails is fetched again. Not the command
        line's ``otfload load --verify``, which compares the loaded model's logits with transformers.
    adapter
        PEFT LoRA adapter(s): a location (as the checkpoint's, or ``"org/name@revision"``), a
        ``Source``, or a list of them, merged into the base weights in order, per device box, in
        float32. A checkpoint location that holds an adapter and no model loads its
        ``base_model_name_or_path``. docs/adapters.md lists what is merged and what can be kept.
    merge_adapter
        ``False`` keeps one adapter's LoRA factors as their own parameters (``LoraWeight``: base,
        ``a`` and ``b`` sharded like the base), merged one layer at a time when the model runs, so
        ``nnx.grad`` reaches ``a``/``b`` (bundled models only: ``from_pretrained``).
    mesh
        The device mesh (default: every device on one ``fsdp`` axis).
    rules
        Logical axis name to mesh axes (default: ``otfload.DEFAULT_RULES``).
    scan_layers
        Stack a bundled model's layers on a leading axis for ``jax.lax.scan`` (one array per layer
        parameter); ``False`` keeps one parameter per layer.
    dtype
        A bundled model's parameter dtype (``"bf16"``, a numpy dtype); ``None`` keeps the storage dtype.
    strict
        Make tensors no parameter uses an error (they are always reported).
    quantized
        ``"dequantize"`` decodes quantized weights (MXFP4, compressed-tensors, FP8) on load;
        ``"keep"`` places them packed as ``QuantizedArray`` (codes and scales), dequantized when the
        model runs (docs/formats.md).
    workers
        Builder threads (default: 2 for local files onto CPU devices, half the CPUs up to 8 onto
        accelerators, 8 for remote sources).
    host_memory_budget
        Scratch bytes in flight (default: the largest leaf).
    progress
        A progress bar in bytes on stderr (default: when stderr is a terminal).
    device_hooks
        Where a leaf's hooks run: ``"auto"`` (on the devices on accelerators), ``"always"``,
        ``"never"`` (on the host); default ``$OTFLOAD_DEVICE_HOOKS``, else ``"auto"``.
    read_ahead
        Read cold local files ahead of the builders (default ``$OTFLOAD_READ_AHEAD``, else on).
    direct_io
        Read cold local files with ``O_DIRECT`` (default ``$OTFLOAD_DIRECT_IO``, else on).
    host_ring_bytes
        On accelerators, the staging bytes the builders keep registered for direct DMA (0: none;
        default ``$OTFLOAD_HOST_RING_BYTES``, else 1 GiB).
    collective_timeout
        Seconds a multi-process load waits at an exchange or for a collective (default
        ``$OTFLOAD_COLLECTIVE_TIMEOUT``, else 600).
    reshard
        When a leaf is read in the storage's own layout (a band of rows, a distinct share per
        process) and moved to its sharding by a collective: ``"auto"`` where the time model says it
        is faster, ``"always"`` wherever it fetches fewer bytes, ``"never"``; default
        ``$OTFLOAD_RESHARD``, else ``"auto"``.

    Raises
    ------
    InvalidOptionError
        A value of the wrong kind or out of range, naming the option, the value and what is allowed
        (``scan_layers="no"``, ``dtype="int8"``, ``workers=0``, ``mesh=(2, 4)``, ...).
    AdapterError
        Several adapters with ``merge_adapter=False``.
    TypeError
        An ``adapter`` that is neither a location, a ``Source`` nor a list of them.

    A ``mesh`` given as a spec (``"fsdp=2,tp=4"``) or a dict of axis sizes is made a ``Mesh``, and a
    ``dtype`` name a numpy dtype (``"auto"``: None), when the object is made. The fields the
    environment can set (``timeout``, ``reshard``, ``device_hooks``, ``read_ahead``, ``direct_io``,
    ``host_ring_bytes``, ``collective_timeout``) are filled from it by ``resolve_options``
    (``otfload.options.environment``).

    Examples
    --------
    >>> import otfload
    >>> options = otfload.LoadOptions(mesh=otfload.make_mesh({"fsdp": 2, "tp": 4}), dtype="bf16")
    >>> model = otfload.from_pretrained("./tiny-llama", options=options, scan_layers=False)
    >>> model.layers[0].attn.q.kernel[...].dtype
    dtype(bfloat16)
    >>> otfload.LoadOptions(quantized="packed")
    Traceback (most recent call last):
    ...
    otfload.errors.InvalidOptionError: quantized='packed': expected one of 'dequantize', 'keep'
    """

    revision: str | None = None
    token: str | None = None
    endpoint: str | None = None
    cache_dir: str | os.PathLike[str] | None = None
    local_files_only: bool = False
    storage_options: dict[str, Any] | None = None
    retry: RetryPolicy | None = None
    timeout: float | None = None
    mmap: bool = True
    shard_cache: ShardCacheSpec = None
    shard_cache_options: dict[str, Any] | None = None
    verify: str = "record"
    adapter: AdapterSpec | Sequence[AdapterSpec] | None = None
    merge_adapter: bool = True
    mesh: Mesh | None = None
    rules: LogicalRules | None = None
    scan_layers: bool = True
    dtype: Any = None
    strict: bool = False
    quantized: str = "dequantize"
    workers: int | None = None
    host_memory_budget: int | None = None
    progress: bool | None = None
    device_hooks: str | None = None
    read_ahead: bool | None = None
    direct_io: bool | None = None
    host_ring_bytes: int | None = None
    collective_timeout: float | None = None
    reshard: str | None = None

    def __post_init__(self) -> None:
        check_quantized_mode(self.quantized)
        for name in ("local_files_only", "mmap", "merge_adapter", "scan_layers", "strict"):
            checks.flag(name, getattr(self, name))
        for name in ("progress", "read_ahead", "direct_io"):
            checks.optional_flag(name, getattr(self, name))
        for name, allowed in (("reshard", RESHARD_POLICIES), ("device_hooks", DEVICE_HOOK_POLICIES)):
            if getattr(self, name) is not None:  # None: from the environment, when the load resolves its options
                checks.one_of(name, getattr(self, name), allowed)
        checks.one_of("verify", self.verify, VERIFY_MODES)
        checks.seconds("timeout", self.timeout)
        checks.seconds("collective_timeout", self.collective_timeout)
        checks.count("workers", self.workers)
        checks.count("host_memory_budget", self.host_memory_budget)
        checks.count("host_ring_bytes", self.host_ring_bytes, least=0)
        object.__setattr__(self, "dtype", checks.cast_dtype("dtype", self.dtype))
        object.__setattr__(self, "mesh", checks.mesh("mesh", self.mesh))
        adapters = self.adapters
        if not self.merge_adapter and len(adapters) > 1:
            raise AdapterError(f"{len(adapters)} adapters with merge_adapter=False: kept LoRA factors are one adapter "
                               "at a time (merge them, or swap adapters with otfload.load_adapter)")

    @property
    def adapters(self) -> list[AdapterSpec]:
        """``adapter`` as a list, in the order the adapters apply."""
        adapter = self.adapter
        if adapter is None:
            return []
        if isinstance(adapter, (str, os.PathLike, Source)):
            return [adapter]
        if isinstance(adapter, Sequence) and all(isinstance(a, (str, os.PathLike, Source)) for a in adapter):
            return list(adapter)
        raise TypeError(f"adapter= must be a location, a Source or a list of them, not {adapter!r}")

    def source_options(self) -> dict[str, Any]:
        """The source options set to other than their defaults: ``open_source``'s keyword arguments."""
        return {name: value for name in SOURCE_FIELDS if not _equal(value := getattr(self, name), DEFAULTS[name])}


DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(LoadOptions)}


class ParamsKeywords(TypedDict, total=False):
    """:class:`LoadOptions`' fields as keyword arguments of ``load_params`` and ``plan_params``."""

    revision: str | None
    token: str | None
    endpoint: str | None
    cache_dir: str | os.PathLike[str] | None
    local_files_only: bool
    storage_options: dict[str, Any] | None
    retry: RetryPolicy | None
    timeout: float | None
    mmap: bool
    shard_cache: ShardCacheSpec
    shard_cache_options: dict[str, Any] | None
    verify: str
    adapter: AdapterSpec | Sequence[AdapterSpec] | None
    merge_adapter: bool
    mesh: Mesh | None
    rules: LogicalRules | None
    strict: bool
    quantized: str
    workers: int | None
    host_memory_budget: int | None
    progress: bool | None
    device_hooks: str | None
    read_ahead: bool | None
    direct_io: bool | None
    host_ring_bytes: int | None
    collective_timeout: float | None
    reshard: str | None


class LoadKeywords(ParamsKeywords, total=False):
    """:class:`LoadOptions`' fields as keyword arguments of ``from_pretrained`` and ``plan_model``."""

    scan_layers: bool
    dtype: Any


def resolve_options(
    options: LoadOptions | None, keywords: Mapping[str, Any], *, unused: Sequence[str] = ()
) -> LoadOptions:
    """``options`` with ``keywords`` (option fields by name) merged in: a keyword sets a field the
    object leaves at its default, or repeats its value; a keyword and a field set to different
    values raise :class:`InvalidOptionError`. A keyword that is no field, or one in ``unused`` (the
    fields the entry point has no use for), raises ``TypeError``. The fields still unset that the
    environment sets are then taken from it (:func:`with_environment`)."""
    if options is not None and not isinstance(options, LoadOptions):
        raise TypeError(f"options= takes a LoadOptions, not {type(options).__name__}")
    unknown = sorted(set(keywords) - set(DEFAULTS))
    if unknown:
        raise TypeError(f"unknown option(s) {unknown}; expected some of {sorted(set(DEFAULTS) - set(unused))}")
    misplaced = sorted(set(keywords) & set(unused))
    if misplaced:
        raise TypeError(f"option(s) {misplaced} do not apply here (a tree you bring fixes its own layout and dtypes)")
    if options is None:
        return with_environment(LoadOptions(**keywords))
    for name, value in keywords.items():
        mine = getattr(options, name)
        if not _equal(mine, DEFAULTS[name]) and not _equal(mine, _checked(name, value)):
            raise InvalidOptionError(f"{name}={value!r} and options.{name}={mine!r}: give each option once")
    return with_environment(dataclasses.replace(options, **keywords) if keywords else options)


# The fields the environment sets when a load leaves them unset (None).
ENVIRONMENT_FIELDS = tuple(VARIABLES)


def with_environment(options: LoadOptions, env: Environment | None = None) -> LoadOptions:
    """``options`` with its unset :data:`ENVIRONMENT_FIELDS` taken from ``env`` (default: read now,
    :func:`~otfload.options.environment.environment`); a set field wins over its variable, which is
    then not even checked."""
    env = environment(given=[name for name in ENVIRONMENT_FIELDS if getattr(options, name) is not None]) \
        if env is None else env
    taken = {name: value for name in ENVIRONMENT_FIELDS
             if getattr(options, name) is None and (value := getattr(env, name)) is not None}
    return dataclasses.replace(options, **taken) if taken else options


def _checked(name: str, value: object) -> object:
    """``value`` as a :class:`LoadOptions` keeps it (a dtype name as its dtype, a mesh spec as a
    ``Mesh``), to compare with a field already checked."""
    if name == "dtype":
        return checks.cast_dtype(name, value)
    if name == "mesh":
        return checks.mesh(name, value)
    return value


def _equal(a: object, b: object) -> bool:
    """``a == b`` for option values (a mesh, a dtype or its name, a dict, ...); unlike types that
    refuse the comparison are unequal."""
    if a is b:
        return True
    try:
        return bool(a == b)
    except (TypeError, ValueError):
        return False


__all__ = ["ENVIRONMENT_FIELDS", "LoadKeywords", "LoadOptions", "ParamsKeywords", "ShardCacheSpec", "resolve_options",
           "with_environment"]
