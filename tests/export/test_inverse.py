"""Hook inverses and inverse plans on numpy: forward then inverse is the identity, bit for bit."""

import itertools

import ml_dtypes
import numpy as np
import pytest

from otfload.errors import MappingError
from otfload.export.inverse import plan_export
from otfload.export.shapes import infer_in_shape
from otfload.plan.hooks import Reshape, Scale, Slice, Transpose, chain_shapes, run_forward
from otfload.plan.mapping import MappingTable, Rule, format_key

RNG = np.random.default_rng(0)


def _undo(hooks, x):
    """Run the inverses of ``hooks`` (resolved, forward input ``x``) on ``run_forward(hooks, x)``."""
    shapes = chain_shapes(hooks, x.shape)
    y = run_forward(hooks, x)
    for hook, shape in zip(reversed(hooks), reversed(shapes[:-1]), strict=True):
        y = hook.inverse(shape).forward(y)
    return y


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
@pytest.mark.parametrize(
    "hooks, shape",
    [
        ((Transpose(),), (6, 4)),
        ((Transpose((2, 0, 1)),), (2, 3, 4)),
        ((Transpose(), Reshape((4, 3, 2))), (6, 4)),
        ((Transpose(), Reshape((3, 2, 4))), (4, 6)),
        ((Reshape((2, 3)),), (6,)),
        ((Scale(2.0), Transpose()), (3, 5)),
        ((Scale(0.25),), (7,)),
    ],
)
def test_forward_then_inverse_is_identity(hooks, shape, dtype):
    x = RNG.standard_normal(shape).astype(dtype)
    y = _undo(hooks, x)
    assert y.dtype == x.dtype and y.shape == x.shape
    assert np.array_equal(y.view(np.uint8), x.view(np.uint8))


def _forward_load(table, config, hf, leaf_shapes):
    """An independent numpy loader: each leaf from its HF tensors through the forward hooks."""
    leaves = {}
    for path, shape in leaf_shapes.items():
        rule, fixed, axes = table.find(path)
        hooks = tuple(h.resolve(config) for h in rule.hooks)
        stack = shape[: len(axes)]
        offsets = {k: config[v] if isinstance(v, str) else v for k, v in rule.offsets.items()}
        slices = []
        for combo in itertools.product(*(range(n) for n in stack)):
            values = {**fixed, **dict(zip(axes, combo, strict=True))}
            values = {k: v + offsets.get(k, 0) for k, v in values.items()}
            key = format_key(rule.source, values)
            key = key if key in hf else format_key(rule.fallbacks[0], values)
            slices.append(run_forward(hooks, hf[key]))
        leaves[path] = np.stack(slices).reshape(shape) if stack else slices[0]
    return leaves


def _round_trip(table, config, hf, leaf_shapes, hf_shapes=None, tied=False):
    leaves = _forward_load(table, config, hf, leaf_shapes)
    plan = plan_export(leaf_shapes, table, config, hf_shapes, tied=tied)
    return {key: t.materialize(lambda leaf, index: leaves[leaf][index]) for key, t in plan.tensors.items()}


CONFIG = {"hidden": 8, "heads": 2, "head_dim": 3, "inter": 5, "nope": 2, "first_dense": 1}
MOE = MappingTable((
    Rule("embed", "model.embed.weight"),
    Rule("lm_head", "lm_head.weight", (Transpose(),), fallbacks=("model.embed.weight",)),
    # GPT-OSS style interleave: gate = even columns, up = odd columns of one fused tensor.
    Rule("moe.gate", "model.layers.{layer}.experts.{expert}.gate_up", (Slice(-1, 0, None, 2),),
         offsets={"layer": "first_dense"}),
    Rule("moe.up", "model.layers.{layer}.experts.{expert}.gate_up", (Slice(-1, 1, None, 2),),
         offsets={"layer": "first_dense"}),
    # DeepSeek style: transpose, split heads, then split each head's dims in two leaves.
    Rule("layers.{layer}.attn.k_nope", "model.layers.{layer}.kv_b.weight",
         (Transpose(), Reshape(("hidden", "heads", -1)), Slice(2, 0, "nope"))),
    Rule("layers.{layer}.attn.v", "model.layers.{layer}.kv_b.weight",
         (Transpose(), Reshape(("hidden", "heads", -1)), Slice(2, "nope", None))),
    Rule("layers.{layer}.attn.o", "model.layers.{layer}.o.weight", (Transpose(), Reshape(("heads", "head_dim", -1)))),
))
MOE_HF = {
    "model.embed.weight": (11, 8),
    "lm_head.weight": (11, 8),
    **{f"model.layers.{i}.experts.{e}.gate_up": (8, 10) for i in (1, 2) for e in range(3)},
    **{f"model.layers.{i}.kv_b.weight": (2 * 5, 8) for i in (0, 1)},
    **{f"model.layers.{i}.o.weight": (8, 6) for i in (0, 1)},
}
MOE_LEAVES = {
    "embed": (11, 8), "lm_head": (8, 11), "moe.gate": (2, 3, 8, 5), "moe.up": (2, 3, 8, 5),
    "layers.0.attn.k_nope": (8, 2, 2), "layers.0.attn.v": (8, 2, 3),
    "layers.1.attn.k_nope": (8, 2, 2), "layers.1.attn.v": (8, 2, 3),
    "layers.0.attn.o": (2, 3, 8), "layers.1.attn.o": (2, 3, 8),
}


@pytest.mark.parametrize("with_shapes", [True, False])
def test_stacks_slices_and_offsets_round_trip(with_shapes):
    hf = {k: RNG.standard_normal(s).astype(np.float32) for k, s in MOE_HF.items()}
    out = _round_trip(MOE, CONFIG, hf, MOE_LEAVES, MOE_HF if with_shapes else None)
    assert out.keys() == hf.keys()
    for key in hf:
        assert np.array_equal(out[key], hf[key]), key


def test_tied_head_is_not_written_when_tied():
    hf = {k: RNG.standard_normal(s).astype(np.float32) for k, s in MOE_HF.items() if k != "lm_head.weight"}
    plan = plan_export({"embed": (11, 8), "lm_head": (8, 11)}, MOE, CONFIG, tied=True)
    assert list(plan.tensors) == ["model.embed.weight"]
    untied = _round_trip(MOE, CONFIG, hf, {"embed": (11, 8), "lm_head": (8, 11)})
    assert np.array_equal(untied["lm_head.weight"], hf["model.embed.weight"])


@pytest.mark.parametrize(
    "rules, leaves, hf_shape, message",
    [
        ((Rule("a", "x"),), {"a": (4,), "b": (4,)}, (4,), "no mapping rule"),
        ((Rule("a", "x"), Rule("b", "x")), {"a": (4,), "b": (4,)}, (4,), "do not slice"),
        ((Rule("a", "x", (Slice(0, 0, 2),)), Rule("b", "x", (Slice(0, 1, 3),))), {"a": (2,), "b": (2,)}, (4,),
         "exactly once"),
        ((Rule("a", "x", (Slice(0, 0, None, 2),)),), {"a": (2,)}, (4,), "exactly once"),
        ((Rule("a", "x", (Slice(0, 0, 4), Slice(0, 0, 2))),), {"a": (2,)}, (4,), "more than once"),
        ((Rule("a", "x", (Slice(0, 0, 2),)), Rule("b", "x", (Transpose(), Slice(1, 2, 4)))),
         {"a": (2, 2), "b": (2, 2)}, (4, 2), "different hooks"),
    ],
)
def test_tables_that_cannot_be_inverted_raise(rules, leaves, hf_shape, message):
    with pytest.raises(MappingError, match=message):
        plan_export(leaves, MappingTable(rules), {}, {"x": hf_shape})


def test_reshape_shape_inference_merges_head_dims_and_refuses_to_guess():
    q, o = Reshape(("hidden", "heads", "head_dim")), Reshape(("heads", "head_dim", "hidden"))
    assert infer_in_shape(q.resolve(CONFIG), (8, 2, 3), "q") == (8, 6)
    assert infer_in_shape(o.resolve(CONFIG), (2, 3, 8), "o") == (6, 8)
    assert infer_in_shape(Transpose((1, 2, 0)), (3, 4, 2), "t") == (2, 3, 4)
    with pytest.raises(MappingError, match="'x'.*reference="):
        infer_in_shape(Reshape((2, 3)), (2, 3), "x")


def test_reference_shape_that_does_not_fit_the_leaf_raises():
    with pytest.raises(MappingError, match="does not fit"):
        plan_export({"a": (3, 2)}, MappingTable((Rule("a", "x", (Transpose(),)),)), {}, {"x": (3, 2)})
