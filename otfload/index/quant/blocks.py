"""Block-grid math shared by every quantized format: which scale entries cover a box, and how to
apply one value per block to a box without expanding the scales.

A scale grid gives one value per block of ``block[d]`` elements along each axis ``d`` (a per-tensor
scale is one block as large as the tensor, a per-channel scale a ``(1, cols)`` block, a group scale
``(1, group)``, DeepSeek's FP8 ``(128, 128)``). Applying it to a box of the tensor splits each axis
of the box into at most three pieces — a partial block at each end and whole blocks between — and
multiplies each piece by a broadcast view of its scales: splitting an axis ``n*b`` into ``(n, b)``
is always a view, so no scale is ever repeated into a box-sized array (``np.repeat`` did that).
Memory is the box itself; work is at most ``3**ndim`` vectorised operations.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

Box = tuple[tuple[int, int], ...]


def block_box(box: Box, block: tuple[int, ...]) -> Box:
    """The box of a scale grid whose blocks cover ``box`` of the tensor."""
    return tuple((start // b, -(-stop // b)) for (start, stop), b in zip(box, block, strict=True))


def apply_blocks(
    values: np.ndarray,
    params: np.ndarray,
    box: Box,
    block: tuple[int, ...],
    op: Callable[..., np.ndarray] = np.multiply,
) -> np.ndarray:
    """``values`` (the ``box`` of a tensor) ``op``-ed in place with one entry of ``params`` per block.

    ``params`` is the :func:`block_box` of the scale grid; returns ``values``.
    """
    pieces = [_pieces(start, stop, b) for (start, stop), b in zip(box, block, strict=True)]
    for combo in itertools.product(*pieces):
        vslices = tuple(p[0] for p in combo)
        sslices = tuple(p[1] for p in combo)
        part = values[vslices]
        if part.size == 0:
            continue
        vshape, sshape = [], []
        for (_, ss, b), n in zip(combo, part.shape, strict=True):
            if b:
                vshape += [n // b, b]
                sshape += [ss.stop - ss.start, 1]
            else:
                vshape.append(n)
                sshape.append(1)
        view = part.reshape(vshape)
        op(view, params[sslices].reshape(sshape), out=view, casting="unsafe")
    return values


def _pieces(start: int, stop: int, b: int) -> list[tuple[slice, slice, int]]:
    """Split ``[start, stop)`` into a partial head block, whole blocks, and a partial tail block.

    Each piece is (slice of the box, slice of the covering scale entries, ``b`` for whole blocks or
    0 for a single partial block).
    """
    first = start // b
    pieces = []
    pos = start
    head_end = min(stop, (first + 1) * b)
    if start % b or head_end - start < b:
        pieces.append((slice(0, head_end - start), slice(0, 1), 0))
        pos = head_end
    whole = (stop - pos) // b
    if whole:
        s0 = pos // b - first
        pieces.append((slice(pos - start, pos - start + whole * b), slice(s0, s0 + whole), b))
        pos += whole * b
    if pos < stop:
        s0 = pos // b - first
        pieces.append((slice(pos - start, stop - start), slice(s0, s0 + 1), 0))
    return pieces
