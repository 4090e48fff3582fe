"""HF tensor shapes inferred backwards through hooks, for exports without a reference checkpoint.

Most hooks determine their input shape from their output shape. A :class:`Reshape` does not: the
leaf ``[hidden, heads, head_dim]`` could come from ``[hidden, heads * head_dim]`` or from
``[hidden * heads, head_dim]``. HF checkpoints store attention projections with the head dims
merged, so the inverse merges the one run of adjacent reshape dims that the table names after
head counts or sizes (config fields containing ``head``; a lone one with an adjacent ``-1``).
Tables this rule does not fit need the reference checkpoint (``export_hf(..., reference=...)``),
which gives exact shapes.
"""

from __future__ import annotations

import math

from otfload.errors import MappingError
from otfload.plan.hooks import Hook, Reshape, Scale, Shape, Slice, Transpose


def slice_positions(hook: Slice, shape: Shape) -> range:
    """The indices along ``hook.axis`` of an input of ``shape`` that ``hook`` keeps."""
    return range(shape[hook.axis % len(shape)])[slice(hook.start, hook.stop, hook.step)]


def _head_run(spec: tuple) -> tuple[int, int] | None:
    """``(start, stop)`` of the one run of adjacent head-named entries of a reshape spec, extended
    by an adjacent ``-1`` when it is a single entry (``("rank", "heads", -1)``); None if ambiguous."""
    named = [isinstance(d, str) and "head" in d for d in spec]
    runs, start = [], None
    for i, flag in enumerate([*named, False]):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    if len(runs) != 1:
        return None
    a, b = runs[0]
    if b - a == 1 and b < len(spec) and spec[b] == -1:
        b += 1
    elif b - a == 1 and a > 0 and spec[a - 1] == -1:
        a -= 1
    return (a, b) if b - a >= 2 else None


def infer_in_shape(hook: Hook, unresolved: Hook, out_shape: Shape, key: str) -> Shape:
    """The input shape of ``hook`` (resolved) producing ``out_shape``; ``unresolved`` is the same
    hook as written in the table (its config field names guide :class:`Reshape`)."""
    out_shape = tuple(out_shape)
    if isinstance(hook, Transpose):
        perm = hook._perm(len(out_shape))
        shape = [0] * len(out_shape)
        for out_dim, in_dim in enumerate(perm):
            shape[in_dim] = out_shape[out_dim]
        return tuple(shape)
    if isinstance(hook, Scale):
        return out_shape
    if isinstance(hook, Reshape):
        run = _head_run(tuple(unresolved.shape))
        if run is None:
            raise MappingError(f"cannot tell the HF shape of {key!r} through {unresolved}; "
                               "pass the checkpoint it was loaded from as reference=")
        a, b = run
        return (*out_shape[:a], math.prod(out_shape[a:b]), *out_shape[b:])
    try:
        if tuple(hook.out_shape(out_shape)) == out_shape:
            return out_shape
    except (MappingError, NotImplementedError, ValueError, IndexError):
        pass
    raise MappingError(f"cannot tell the HF shape of {key!r} through {hook}; pass reference=")
