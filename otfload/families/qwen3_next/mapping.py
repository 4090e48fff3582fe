"""Qwen3-Next's mapping table and checks: :mod:`otfload.families.hybrid_rules`' groups, whose linear
layers split the projections Qwen3-Next fuses per key head.

``in_proj_qkvz`` holds, for each of the ``hk`` key heads in turn, its query (``dk`` rows), key
(``dk``), value (``r * dv``) and ``z`` (``r * dv``) rows, ``r = hv / hk`` value heads per key head;
``in_proj_ba`` its ``b`` (``r`` rows) then ``a`` (``r``). Each is reshaped to ``(hk, rows per key
head, hidden)`` and sliced on the middle axis into the layer's ``q``, ``k``, ``v``, ``z``, ``b`` and
``a`` leaves (:class:`~otfload.models.gated_delta.GatedDeltaNet` with ``per_key_head``), so a device
reads only its key heads' rows, and export joins the slices back. The depthwise ``conv1d`` (its
channels by kind: every query head's, every key head's, every value head's) is sliced into the query,
key and value taps and each reshaped by key head (``conv_q``, ``conv_k``, ``conv_v``), as the
projections they convolve."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from otfload.config import Count, Dim
from otfload.families.hybrid_rules import LINEAR_COMMON, Leaves, hybrid_checks, hybrid_table
from otfload.families.qwen3_next.config import Qwen3NextConfig
from otfload.models.hybrid_decoder import LayerKind
from otfload.plan.hooks import Reshape, Slice
from otfload.plan.mapping import MappingTable

DK = "linear_key_head_dim"
R = "linear_num_value_heads // linear_num_key_heads"  # value heads per key head
RV = f"{R} * linear_value_head_dim"  # value (and z) rows per key head
QKVZ_ROWS = f"2 * {DK} + 2 * {RV}"
QKVZ = Reshape(("linear_num_key_heads", QKVZ_ROWS, "hidden_size"))
BA = Reshape(("linear_num_key_heads", f"2 * {R}", "hidden_size"))
PROJECTIONS: Leaves = {
    "linear_attn.q.kernel": ("linear_attn.in_proj_qkvz.weight", (QKVZ, Slice(1, 0, DK))),
    "linear_attn.k.kernel": ("linear_attn.in_proj_qkvz.weight", (QKVZ, Slice(1, DK, f"2 * {DK}"))),
    "linear_attn.v.kernel": ("linear_attn.in_proj_qkvz.weight", (QKVZ, Slice(1, f"2 * {DK}", f"2 * {DK} + {RV}"))),
    "linear_attn.z.kernel": ("linear_attn.in_proj_qkvz.weight", (QKVZ, Slice(1, f"2 * {DK} + {RV}"))),
    "linear_attn.b.kernel": ("linear_attn.in_proj_ba.weight", (BA, Slice(1, 0, R))),
    "linear_attn.a.kernel": ("linear_attn.in_proj_ba.weight", (BA, Slice(1, R))),
}
HK, TAPS = "linear_num_key_heads", "linear_conv_kernel_dim"
KEYS = f"{HK} * {DK}"  # query (and key) channels of the conv
CONV = "linear_attn.conv1d.weight"
CONV_TAPS: Leaves = {
    "linear_attn.conv_q": (CONV, (Slice(0, 0, KEYS), Reshape((HK, DK, 1, TAPS)))),
    "linear_attn.conv_k": (CONV, (Slice(0, KEYS, f"2 * {KEYS}"), Reshape((HK, DK, 1, TAPS)))),
    "linear_attn.conv_v": (CONV, (Slice(0, f"2 * {KEYS}"), Reshape((HK, RV, 1, TAPS)))),
}
COMMON: Leaves = {leaf: read for leaf, read in LINEAR_COMMON.items() if leaf != "linear_attn.conv"}


@functools.cache
def _table(kinds: tuple[LayerKind, ...]) -> MappingTable:
    return hybrid_table(kinds, {**PROJECTIONS, **CONV_TAPS}, COMMON)


def qwen3_next_table(cfg: Qwen3NextConfig) -> MappingTable:
    """The table of ``cfg``'s layer groups."""
    return _table(cfg.layer_kinds())


def _projections(cfg: Qwen3NextConfig, at: str) -> list[Dim]:
    hk, r = cfg.linear_num_key_heads, cfg.linear_num_value_heads // cfg.linear_num_key_heads
    rows = 2 * cfg.linear_key_head_dim + 2 * r * cfg.linear_value_head_dim
    return [Dim("linear_num_key_heads", hk, f"{at}.in_proj_qkvz.weight", 0, (QKVZ_ROWS, rows)),
            Dim("linear_num_value_heads", cfg.linear_num_value_heads, f"{at}.in_proj_ba.weight", 0, ("2", 2)),
            Dim("linear_num_value_heads", cfg.linear_num_value_heads, f"{at}.out_proj.weight", 1,
                ("linear_value_head_dim", cfg.linear_value_head_dim))]


def qwen3_next_checks(cfg: Qwen3NextConfig, config: Mapping[str, Any]) -> tuple[Count | Dim, ...]:
    """:func:`~otfload.families.hybrid_rules.hybrid_checks` with the fused projections' rows."""
    return hybrid_checks(cfg, functools.partial(_projections, cfg))
