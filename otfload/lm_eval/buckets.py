"""Padded widths chosen from the data: few compiled shapes, little padding.

Every distinct ``[batch, width]`` the scoring step sees is one XLA compilation (seconds on an
accelerator for a real model), while every padded slot is wasted work. Powers of two bound the
shapes but can nearly double the work of a batch just past one; one width per batch pads nothing
but compiles once per distinct length. Here the batches' own lengths decide: given the longest row
of each batch (requests are sorted by length, so batches are known before any is run), at most
``max_shapes`` widths are chosen, each a multiple of ``align``, minimising the total padded width
summed over batches. An exact dynamic program over the distinct candidate widths (at most
``max_width / align`` of them) does it in a few milliseconds.

The widths depend only on the lengths, so a second job over the same data asks for the same shapes
and finds them in XLA's persistent compilation cache.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

# At most this many widths per job: each costs one compilation, and past four the padding saved is
# a few percent on the length distributions of lm_eval's tasks (MMLU, HellaSwag, ARC, wikitext).
MAX_SHAPES = 4
# Widths are multiples of this: a vector-friendly tile on every backend, and it keeps the set of
# candidates small (max_width / ALIGN) for the dynamic program.
ALIGN = 16


def choose_widths(lengths: Sequence[int], max_width: int, *, max_shapes: int = MAX_SHAPES,
                  align: int = ALIGN) -> list[int]:
    """Ascending widths (each a multiple of ``align``, or ``max_width``) covering every length in
    ``lengths`` (one per batch, each at most ``max_width``) with the least total padded width."""
    if not lengths:
        return []
    if max_shapes < 1:
        raise ValueError(f"max_shapes must be at least 1; got {max_shapes}")
    counts = Counter(min(-(-n // align) * align, max_width) for n in lengths)
    candidates = sorted(counts)
    n = len(candidates)
    # best[k][j]: least total width of the batches up to candidate j (inclusive) with k widths,
    # the largest of them candidates[j]; choice[k][j]: the previous width's index (-1: none).
    inf = float("inf")
    best = [[inf] * n for _ in range(max_shapes + 1)]
    choice = [[-1] * n for _ in range(max_shapes + 1)]
    below = [0] * (n + 1)  # below[j]: batches at candidates before j
    for j in range(n):
        below[j + 1] = below[j] + counts[candidates[j]]
    for j in range(n):
        best[1][j] = below[j + 1] * candidates[j]
    for k in range(2, max_shapes + 1):
        for j in range(n):
            for i in range(j):
                cost = best[k - 1][i] + (below[j + 1] - below[i + 1]) * candidates[j]
                if cost < best[k][j]:
                    best[k][j], choice[k][j] = cost, i
    k = min(range(1, max_shapes + 1), key=lambda k: (best[k][n - 1], k))
    widths, j = [], n - 1
    while j >= 0 and k >= 1:
        widths.append(candidates[j])
        j, k = choice[k][j], k - 1
    return sorted(widths)


def width_for(length: int, widths: Sequence[int]) -> int:
    """The narrowest of ``widths`` (ascending) that holds ``length``."""
    for width in widths:
        if width >= length:
            return width
    raise ValueError(f"no width holds {length} (widths {list(widths)})")
