"""One source over a base checkpoint and its adapters, so one reader (and one load report) reads both.

Adapter files appear under a namespace per adapter (``@adapter0/adapter_model.safetensors``); every
other name is the base's. Reads, mapped views, prefetches and releases are routed to the source that
holds the file, so a local adapter is memory-mapped like a local checkpoint and a Hub adapter is read
by range like a Hub checkpoint. The combined source is a
:class:`~otfload.sources.base.MappedSource` and a :class:`~otfload.sources.base.PageGranularSource`
whatever its parts are: a file on a part that maps nothing has no mapped view (:meth:`mapped` is
None, prefetch and release do nothing), and the source-wide answers are the base's.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from otfload.accounting.gaps import DEFAULT_GAPS, GapPolicy
from otfload.sources.base import MappedSource, PageGranularSource, RangeRead, Source, read_many

NAMESPACE = "@adapter{}/"


def adapter_file(index: int, file: str) -> str:
    """The combined name of ``file`` of adapter ``index``."""
    return NAMESPACE.format(index) + file


class CombinedSource:
    """``base`` plus ``adapters`` as one :class:`~otfload.sources.Source`. ``close()`` closes only the
    sources in ``owned`` (those the loader opened itself, not those a caller passed in)."""

    def __init__(self, base: Source, adapters: Sequence[Source], owned: Sequence[Source] = ()):
        self.base = base
        self.adapters = list(adapters)
        self._owned = list(owned)
        self._prefixes = {NAMESPACE.format(i): s for i, s in enumerate(self.adapters)}
        # The parts that map their files, by id: checked once here (a Protocol check costs ~17 µs;
        # mapped/prefetch/release run once per tensor box).
        self._mapping: dict[int, MappedSource] = {
            id(s): s for s in (base, *self.adapters) if isinstance(s, MappedSource)
        }

    @property
    def use_mmap(self) -> bool:
        """Whether reads are mapped views: the base's answer (its bytes dominate); an adapter file on a
        source that does not map is read by range (:meth:`mapped` returns None for it)."""
        return isinstance(self.base, MappedSource) and self.base.use_mmap

    @property
    def page_granular(self) -> bool:
        """Whether the kernel reads the files in whole pages (local files): the base's answer."""
        return isinstance(self.base, PageGranularSource) and self.base.page_granular

    @property
    def description(self) -> str:
        return " + ".join([self.base.description, *(f"adapter {a.description}" for a in self.adapters)])

    def route(self, file: str) -> tuple[Source, str]:
        """The source holding ``file`` and the file's name in it."""
        if file.startswith("@"):
            prefix, _, rest = file.partition("/")
            source = self._prefixes.get(prefix + "/")
            if source is not None:
                return source, rest
        return self.base, file

    def list_files(self) -> list[str]:
        names = list(self.base.list_files())
        for prefix, source in self._prefixes.items():
            names += [prefix + f for f in source.list_files()]
        return names

    def size(self, file: str) -> int:
        source, name = self.route(file)
        return source.size(name)

    def read_into(self, file: str, offset: int, out: memoryview) -> None:
        source, name = self.route(file)
        source.read_into(name, offset, out)

    def read_many(self, reads: Sequence[RangeRead], gaps: GapPolicy = DEFAULT_GAPS) -> None:
        groups: dict[int, tuple[Source, list[RangeRead]]] = {}
        by_source: dict[int, list[RangeRead]] = defaultdict(list)
        for read in reads:
            source, name = self.route(read.file)
            groups.setdefault(id(source), (source, by_source[id(source)]))
            by_source[id(source)].append(read._replace(file=name))
        for source, group in groups.values():
            read_many(source, group, gaps)

    def _mapped_route(self, file: str) -> tuple[MappedSource | None, str]:
        """The part holding ``file`` if it maps its files (else None), and the file's name in it."""
        source, name = self.route(file)
        return self._mapping.get(id(source)), name

    def mapped(self, file: str, offset: int = 0, length: int = 0) -> memoryview | None:
        source, name = self._mapped_route(file)
        return source.mapped(name, offset, length) if source is not None else None

    def prefetch(self, file: str, offset: int, length: int) -> None:
        source, name = self._mapped_route(file)
        if source is not None:
            source.prefetch(name, offset, length)

    def release(self, file: str, offset: int, length: int) -> None:
        source, name = self._mapped_route(file)
        if source is not None:
            source.release(name, offset, length)

    def close(self) -> None:
        errors = []
        for source in self._owned:
            try:
                source.close()
            except Exception as e:  # close the others first, then report the first failure
                errors.append(e)
        self._owned = []
        if errors:
            raise errors[0]


__all__ = ["CombinedSource", "adapter_file"]
