"""Exact ``needed`` for widening hooks: a selection (a box with holes) carried back through the hooks
holds every source element the output box uses — and, for DeepSeek's ``kv_b_proj`` heads and
GPT-OSS's interleaved ``gate_up_proj``, nothing else. Checked in numpy against the whole tensor."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from otfload.plan.boxes import (
    box_selection,
    box_to_slices,
    crop,
    selection_bounds,
    selection_pieces,
    selection_size,
    selection_union,
)
from otfload.plan.hooks import (
    Reshape,
    Scale,
    Slice,
    Transpose,
    chain_apply,
    chain_needed,
    chain_selection,
    chain_shapes,
)
from tests.plan.test_hooks import CHAINS, CONFIG, sample_boxes

HEADS, NOPE, V, LORA = 4, 3, 2, 5
# DeepSeek: kv_b_proj [heads * (nope + v), kv_lora] viewed per head, split into k_b and v_b.
KV_B = Reshape((HEADS, -1, LORA))
K_B = ((HEADS * (NOPE + V), LORA), (KV_B, Slice(1, 0, NOPE)))
V_B = ((HEADS * (NOPE + V), LORA), (KV_B, Slice(1, NOPE)))
# GPT-OSS: gate_up_proj [experts, hidden, 2 * inter], gate and up interleaved on the last axis.
GATE = ((3, 4, 10), (Slice(-1, 0, None, 2),))
UP = ((3, 4, 10), (Slice(-1, 1, None, 2),))
EXACT = {"k_b": K_B, "v_b": V_B, "gate": GATE, "up": UP}


def used_elements(in_shape, hooks, box) -> set[int]:
    """Flat indices of the source elements the output ``box`` is made of (forward, on indices)."""
    index = np.arange(int(np.prod(in_shape))).reshape(in_shape)
    out = index
    for hook in hooks:
        out = hook.forward(out) if not isinstance(hook, Scale) else out
    return set(out[box_to_slices(box)].ravel().tolist())


def selected_elements(in_shape, selection) -> set[int]:
    index = np.arange(int(np.prod(in_shape))).reshape(in_shape)
    return {int(v) for b in itertools.product(*selection) for v in index[box_to_slices(b)].ravel()}


def check(in_shape, hooks, box, exact: bool) -> None:
    shapes = chain_shapes(hooks, in_shape)
    need, sel = chain_needed(hooks, shapes, box), chain_selection(hooks, shapes, box)
    used, chosen = used_elements(in_shape, hooks, box), selected_elements(in_shape, sel)
    assert used <= chosen, (box, sel)  # nothing the output needs is skipped
    assert chosen <= selected_elements(in_shape, box_selection(need))  # inside the box the reader reads
    if exact:
        assert chosen == used, (box, sel)
    # Reading only the selection (NaN in the holes) and applying the hooks gives numpy's answer.
    x = np.random.default_rng(0).standard_normal(in_shape).astype(np.float32)
    holes = np.full(in_shape, np.nan, np.float32)
    for b in itertools.product(*sel):
        holes[box_to_slices(b)] = x[box_to_slices(b)]
    out, have = chain_apply(hooks, shapes, holes[box_to_slices(need)], need)
    x_out = x
    for hook in hooks:
        x_out = hook.forward(x_out)
    np.testing.assert_array_equal(crop(out, have, box), x_out[box_to_slices(box)])


@pytest.mark.parametrize("name", list(EXACT))
def test_widening_hooks_select_exactly_the_elements_used(name):
    in_shape, hooks = EXACT[name]
    shapes = chain_shapes(hooks, in_shape)
    for box in sample_boxes(shapes[-1], limit=150):
        check(in_shape, hooks, box, exact=True)


@pytest.mark.parametrize("in_shape,hooks", CHAINS)
def test_every_chain_selects_what_its_output_uses(in_shape, hooks):
    hooks = tuple(h.resolve(CONFIG) for h in hooks)
    shapes = chain_shapes(hooks, in_shape)
    for box in sample_boxes(shapes[-1], limit=100):
        check(in_shape, hooks, box, exact=False)


def test_kv_b_leaves_each_read_half_of_the_tensor():
    in_shape, _ = K_B
    whole = np.prod(in_shape)
    halves = []
    for _, hooks in (K_B, V_B):
        shapes = chain_shapes(hooks, in_shape)
        sel = chain_selection(hooks, shapes, tuple((0, n) for n in shapes[-1]))
        need = chain_needed(hooks, shapes, tuple((0, n) for n in shapes[-1]))
        assert all(n0 <= s0 < s1 <= n1 for (s0, s1), (n0, n1) in zip(selection_bounds(sel), need, strict=True))
        halves.append(sel)
    assert [selection_size(s) for s in halves] == [HEADS * NOPE * LORA, HEADS * V * LORA]
    assert selection_size(selection_union(halves)) == whole  # together: every byte, once
    assert not selected_elements(in_shape, halves[0]) & selected_elements(in_shape, halves[1])


def test_selection_pieces_hold_exactly_the_selected_bytes():
    shape = (6, 4, 5)
    data = np.arange(np.prod(shape), dtype=np.int32).reshape(shape)
    raw = data.tobytes()
    sel = (((0, 2), (3, 5)), ((1, 3),), ((0, 5),))
    box = selection_bounds(sel)
    dense = bytearray(int(np.prod([b - a for a, b in box])) * 4)
    for src, dst, n in selection_pieces(shape, 4, sel, box):
        dense[dst : dst + n] = raw[src : src + n]
    got = np.frombuffer(bytes(dense), np.int32).reshape([b - a for a, b in box])
    for b in itertools.product(*sel):
        rel = tuple(slice(a - o, z - o) for (a, z), (o, _) in zip(b, box, strict=True))
        np.testing.assert_array_equal(got[rel], data[box_to_slices(b)])
    assert sum(n for _, _, n in selection_pieces(shape, 4, sel, box)) == selection_size(sel) * 4


def test_transpose_carries_a_selection():
    hooks = (Transpose(), *K_B[1])
    in_shape = (LORA, HEADS * (NOPE + V))
    shapes = chain_shapes(hooks, in_shape)
    for box in sample_boxes(shapes[-1], limit=60):
        check(in_shape, hooks, box, exact=True)
