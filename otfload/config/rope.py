"""RoPE fields: ``rope_theta``, ``rope_scaling`` (older configs) and ``rope_parameters`` (transformers 5).

The RoPE kind is ``rope_type`` (or the older ``type``); only the kinds otfload's models implement are
accepted, each with the fields its formula reads, so an unknown kind (``dynamic``, ``longrope``, ...)
is a :class:`~otfload.errors.ConfigError` instead of silently plain RoPE.
"""

from __future__ import annotations

from typing import Any

from otfload.config.fields import BOOL, MAX_ROPE_THETA, POSITIVE, WINDOW, Choice, Fields, Float, Int, Spec, require

DEFAULT = "default"
# A RoPE base must exceed 1: YaRN divides by log(theta), and theta <= 1 gives no rotation frequencies.
THETA = Float(1.0, MAX_ROPE_THETA, exclusive_min=True)
NON_NEGATIVE = Float(0.0)
CONTEXT = WINDOW  # original_max_position_embeddings: a context length

# rope kind -> (required fields, optional fields), as ``otfload.models.layers`` reads them.
ROPE_KINDS: dict[str, tuple[dict[str, Spec], dict[str, Spec]]] = {
    DEFAULT: ({}, {}),
    "linear": ({"factor": POSITIVE}, {}),
    "llama3": (
        {"factor": POSITIVE, "low_freq_factor": POSITIVE, "high_freq_factor": POSITIVE,
         "original_max_position_embeddings": CONTEXT},
        {},
    ),
    "yarn": (
        {"factor": POSITIVE, "original_max_position_embeddings": CONTEXT},
        {"beta_fast": POSITIVE, "beta_slow": POSITIVE, "mscale": NON_NEGATIVE, "mscale_all_dim": NON_NEGATIVE,
         "attention_factor": POSITIVE, "truncate": BOOL},
    ),
}
KIND = Choice(*ROPE_KINDS)


def rope_kind(f: Fields) -> str:
    """Check one RoPE object (a ``rope_scaling`` or ``rope_parameters``) and return its kind.

    The kind is found as the models find it: ``rope_type``, else ``type``, else default (``null`` is
    default too)."""
    key = "rope_type" if "rope_type" in f.data else "type"
    kind: str = f.get(key, KIND, DEFAULT)
    required, optional = ROPE_KINDS[kind]
    for name, spec in required.items():
        f.get(name, spec)
    for name, spec in optional.items():
        f.get(name, spec, None)
    if "rope_theta" in f.data:
        f.get("rope_theta", THETA, None)
    if kind == "llama3":
        low, high = f.data["low_freq_factor"], f.data["high_freq_factor"]
        # Equal factors (Llama 4 Scout) leave no band to smooth between the two wavelengths.
        require(high >= low, f.name("high_freq_factor"), high, f"must be at least low_freq_factor ({low})")
    return kind


def rope_params(f: Fields) -> tuple[float, dict[str, Any] | None]:
    """``(theta, scaling)`` from ``rope_parameters`` or the older ``rope_theta``/``rope_scaling``;
    ``scaling`` is None for plain RoPE."""
    params = f.object("rope_parameters")
    kind = rope_kind(params) if params is not None else DEFAULT
    theta = f.get("rope_theta", THETA, 10000.0)
    if params is not None:
        theta = params.get("rope_theta", THETA, theta)
    scaling = f.object("rope_scaling")
    if scaling is not None and scaling.data:
        rope_kind(scaling)
        return theta, dict(scaling.data)
    return theta, (dict(params.data) if params is not None and kind != DEFAULT else None)


# partial_rotary_factor: the fraction of each head's dims RoPE rotates.
FRACTION = Float(0.0, 1.0, exclusive_min=True)


def rotary_dim(f: Fields, head_dim: int, default_factor: float = 1.0) -> int:
    """How many of each head's ``head_dim`` dims RoPE rotates (the first ones; the rest pass through):
    ``rotary_dim`` (MiniMax-M2's field), else ``head_dim × partial_rotary_factor`` (top level or in
    ``rope_parameters``, as transformers reads it), checked to be even and at most ``head_dim``."""
    params = f.object("rope_parameters")
    factor = f.get("partial_rotary_factor", FRACTION, default_factor)
    if params is not None:
        factor = params.get("partial_rotary_factor", FRACTION, factor)
    dim: int = f.get("rotary_dim", Int(2, head_dim), None) or int(head_dim * factor)
    field = "rotary_dim" if "rotary_dim" in f.data else "partial_rotary_factor"
    require(dim % 2 == 0 and dim >= 2, f.name(field), f.data.get("rotary_dim", factor),
            f"must give an even number of rotated dims (head_dim {head_dim} -> {dim})")
    return dim
