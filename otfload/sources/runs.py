"""Turning many small range reads into few requests, for remote sources: pure grouping.

:func:`coalesce` merges reads of one file whose gaps :func:`~otfload.accounting.gaps.joined_gaps` reads
(the gap is read and thrown away, cheaper than another round trip; the same rule the plan predicts
with, :func:`~otfload.accounting.requests.remote_fetch`) and splits big reads so that no request exceeds
``max_run`` bytes. Each :class:`Run` is one request and says where its bytes go.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from otfload.accounting.gaps import DEFAULT_GAPS, REMOTE_REQUEST_GAP_BYTES, GapPolicy, gap_budget, joined_gaps
from otfload.sources.base import RangeRead

# Cap on one request: bounds the temporary buffer of a coalesced run and splits huge tensors into
# pieces that can be fetched in parallel and retried cheaply.
MAX_RUN_BYTES = 64 << 20


@dataclass(frozen=True)
class Piece:
    """A caller's buffer ``out`` that receives the run's bytes starting ``at`` bytes into the run."""

    at: int
    out: memoryview


@dataclass(frozen=True)
class Run:
    """One request: bytes ``[start, end)`` of ``file``, delivered to ``pieces``."""

    file: str
    start: int
    end: int
    pieces: tuple[Piece, ...]

    @property
    def direct(self) -> bool:
        """True when a single buffer covers the run exactly, so it can be read into without a copy."""
        return len(self.pieces) == 1 and self.pieces[0].at == 0 and len(self.pieces[0].out) == self.end - self.start


Segment = tuple[str, int, memoryview]  # (file, offset, buffer): a read, or a piece of a split one


def _split(read: RangeRead, max_run: int) -> list[tuple[int, memoryview]]:
    out = read.out.cast("B")
    return [(read.offset + i, out[i : i + max_run]) for i in range(0, len(out), max_run)]


def _joined(segments: Sequence[Segment], gap: int, budget: int) -> list[bool]:
    """``joined[k]``: the hole between segment ``k`` and ``k + 1`` (sorted) is read — holes within
    one file only, chosen by :func:`~otfload.accounting.gaps.joined_gaps` (overlaps count as 0 bytes)."""
    pairs: list[int] = []
    holes: list[int] = []
    end = 0
    for k in range(len(segments) - 1):
        file, start, out = segments[k]
        end = max(end, start + len(out)) if k and segments[k - 1][0] == file else start + len(out)
        if segments[k + 1][0] == file:
            pairs.append(k)
            holes.append(max(0, segments[k + 1][1] - end))
    joined = np.zeros(max(0, len(segments) - 1), bool)
    joined[pairs] = joined_gaps(np.array(holes, np.int64), gap, budget)
    return [bool(j) for j in joined]


def coalesce(
    reads: Sequence[RangeRead],
    gap: int = REMOTE_REQUEST_GAP_BYTES,
    max_run: int = MAX_RUN_BYTES,
    policy: GapPolicy = DEFAULT_GAPS,
) -> list[Run]:
    """Group ``reads`` into runs: same file, holes of at most ``gap`` bytes, at most ``max_run`` bytes each.

    Holes are read smallest first, together within the budget ``policy`` gives the batch
    (:func:`~otfload.accounting.gaps.gap_budget`). Reads longer than ``max_run`` are split first;
    overlapping reads share a run. Empty reads vanish.
    """
    segments = sorted(
        ((r.file, start, out) for r in reads for start, out in _split(r, max_run)), key=lambda s: (s[0], s[1])
    )
    asked = sum(len(out) for _, _, out in segments)
    joined = _joined(segments, gap, gap_budget(asked, len({f for f, _, _ in segments}), policy))
    runs: list[Run] = []
    file: str | None = None
    start, end = 0, 0
    pieces: list[Piece] = []
    for k, (seg_file, seg_start, out) in enumerate(segments):
        seg_end = seg_start + len(out)
        near = seg_start <= end or (k > 0 and joined[k - 1])
        if seg_file == file and near and max(end, seg_end) - start <= max_run:
            end = max(end, seg_end)
        else:
            if file is not None:
                runs.append(Run(file, start, end, tuple(pieces)))
            file, start, end, pieces = seg_file, seg_start, seg_end, []
        pieces.append(Piece(seg_start - start, out))
    if file is not None:
        runs.append(Run(file, start, end, tuple(pieces)))
    return runs
