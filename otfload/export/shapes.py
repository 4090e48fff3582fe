"""HF tensor shapes inferred backwards through hooks, for exports without a reference checkpoint.

Each hook answers its own input shape for an output shape (:meth:`~otfload.plan.hooks.Hook.in_shape`);
most are determined by it. A :class:`~otfload.plan.hooks.Reshape` is not, and merges the head dims
its table names (see its ``in_shape``). Tables that rule does not fit need the reference checkpoint
(``export_hf(..., reference=...)``), which gives exact shapes.
"""

from __future__ import annotations

from otfload.errors import MappingError
from otfload.plan.hooks import Hook, Shape, Slice


def slice_positions(hook: Slice, shape: Shape) -> range:
    """The indices along ``hook.axis`` of an input of ``shape`` that ``hook`` keeps."""
    return hook.positions(shape[hook.axis % len(shape)])


def infer_in_shape(hook: Hook, out_shape: Shape, key: str) -> Shape:
    """The input shape of ``hook`` (resolved) producing ``out_shape`` for HF tensor ``key``."""
    try:
        return hook.in_shape(tuple(out_shape))
    except MappingError as e:
        raise MappingError(f"cannot tell the HF shape of {key!r}: {e}; "
                           "pass the checkpoint it was loaded from as reference=") from None
