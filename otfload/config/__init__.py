"""Validation of ``config.json`` before anything is planned: typed, bounded fields
(:mod:`otfload.config.fields`, :mod:`otfload.config.rope`) and the config checked against the
checkpoint's tensors (:mod:`otfload.config.tensors`). Every violation is a
:class:`~otfload.errors.ConfigError`."""

from otfload.config.fields import (
    BOOL,
    EPS,
    EXPERTS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    INTERMEDIATE,
    LAYERS,
    NAME,
    OBJECT,
    POSITIVE,
    REQUIRED,
    VOCAB,
    WINDOW,
    Bool,
    Choice,
    Fields,
    Float,
    Int,
    List,
    Str,
    padding_idx,
    require,
)
from otfload.config.rope import rope_kind, rope_params
from otfload.config.tensors import Count, Dim, TensorCheck, check_tensors

__all__ = [
    "BOOL", "EPS", "EXPERTS", "HEADS", "HEAD_DIM", "HIDDEN", "INTERMEDIATE", "LAYERS", "NAME", "OBJECT", "POSITIVE",
    "REQUIRED", "VOCAB", "WINDOW", "Bool", "Choice", "Count", "Dim", "Fields", "Float", "Int", "List", "Str",
    "TensorCheck", "check_tensors", "padding_idx", "require", "rope_kind", "rope_params",
]
