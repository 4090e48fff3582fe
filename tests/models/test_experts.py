"""Sparse experts: the grouped implementations equal every-expert-on-every-token (whose parity with
transformers the family tests check), with and without expert parallelism, and only ever multiply
one expert's weights at a time."""

import functools

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest

from otfload.models.experts import BLOCKS, DENSE, MAX_BLOCK, RAGGED, block_size, expert_ffn
from otfload.plan.sharding import make_mesh

TOKENS, HIDDEN, INTER, EXPERTS, TOP_K = 37, 16, 24, 8, 3


def _swiglu(g, u):
    return jax.nn.silu(g) * u


def _problem(in_first: bool, bias: bool, seed: int = 0):
    """Random experts and a routing that crowds expert 5 and leaves others empty."""
    rng = np.random.default_rng(seed)

    def kernel(out, inp):
        shape = (EXPERTS, inp, out) if in_first else (EXPERTS, out, inp)
        return jnp.asarray(rng.normal(size=shape), jnp.float32)

    experts = {"gate": {"kernel": kernel(INTER, HIDDEN)}, "up": {"kernel": kernel(INTER, HIDDEN)},
               "down": {"kernel": kernel(HIDDEN, INTER)}}
    if bias:
        for name, out in (("gate", INTER), ("up", INTER), ("down", HIDDEN)):
            experts[name]["bias"] = jnp.asarray(rng.normal(size=(EXPERTS, out)), jnp.float32)
    logits = rng.normal(size=(TOKENS, EXPERTS))
    logits[:, 5] += 3.0
    logits[:, 1] -= 9.0  # never chosen
    weights, idx = jax.lax.top_k(jnp.asarray(logits, jnp.float32), TOP_K)
    x = jnp.asarray(rng.normal(size=(TOKENS, HIDDEN)), jnp.float32)
    return x, idx, jax.nn.softmax(weights), experts


def _run(impl, in_first, x, idx, weights, experts):
    fn = jax.jit(lambda *a: expert_ffn(*a, in_first=in_first, activation=_swiglu, impl=impl))
    return np.asarray(fn(x, idx, weights, experts))


@functools.cache
def _dense_output(in_first: bool, bias: bool) -> np.ndarray:
    """The every-expert route's output on :func:`_problem` (the reference), computed once per layout."""
    return _run(DENSE, in_first, *_problem(in_first, bias))


@pytest.mark.parametrize("mesh_axes", [None, {"fsdp": 2, "ep": 4}, {"ep": 8}], ids=["no_mesh", "fsdp2_ep4", "ep8"])
@pytest.mark.parametrize(("in_first", "bias"), [(False, False), (True, True)], ids=["out_in", "in_out_bias"])
@pytest.mark.parametrize("impl", [BLOCKS, RAGGED])
def test_grouped_experts_equal_every_expert_on_every_token(impl, in_first, bias, mesh_axes):
    x, idx, weights, experts = _problem(in_first, bias)
    ref = _dense_output(in_first, bias)
    if mesh_axes is None:
        got = _run(impl, in_first, x, idx, weights, experts)
    else:
        mesh = make_mesh(mesh_axes)
        with jax.set_mesh(mesh):
            fn = jax.jit(lambda *a: expert_ffn(*a, in_first=in_first, activation=_swiglu, impl=impl))
            jaxpr = str(jax.make_jaxpr(fn)(x, idx, weights, experts))
            assert "shard_map" in jaxpr and "psum" in jaxpr  # experts split over "ep", partial sums added
            got = np.asarray(fn(x, idx, weights, experts))
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5 * np.abs(ref).max())


def _gradients(impl):
    """``jax.grad`` of a loss of ``impl``'s output on :func:`_problem` (in-first, biased) by rows,
    routing weights and experts."""
    _, idx, _, _ = _problem(True, True)

    def loss(x, weights, experts):
        out = expert_ffn(x, idx, weights, experts, in_first=True, activation=_swiglu, impl=impl)
        return jnp.sum(jnp.sin(out))  # a cotangent that differs per row and column

    return jax.grad(loss, argnums=(0, 1, 2))


@functools.cache
def _dense_gradients():
    """The every-expert route's gradients (the reference), computed once."""
    x, _, weights, experts = _problem(True, True)
    return jax.jit(_gradients(DENSE))(x, weights, experts)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("mesh_axes", [None, {"fsdp": 2, "ep": 4}], ids=["no_mesh", "fsdp2_ep4"])
@pytest.mark.parametrize("impl", [BLOCKS, RAGGED])
def test_grouped_experts_gradients_equal_every_expert_on_every_token(impl, mesh_axes, jit):
    """Reverse-mode gradients (rows, routing weights, kernels and biases) of the grouped routes equal
    the dense route's: ``"blocks"`` through its custom VJP, the ``ep`` shard_map eagerly too (an
    un-jitted ``jax.grad``, where a partly manual shard_map used to fail)."""
    x, _, weights, experts = _problem(True, True)
    grads = jax.jit(_gradients(impl)) if jit else _gradients(impl)
    ref = _dense_gradients()
    if mesh_axes is None:
        got = grads(x, weights, experts)
    else:
        with jax.set_mesh(make_mesh(mesh_axes)):
            got = grads(x, weights, experts)
    for name, a, b in zip(("x", "weights", "experts"), got, ref, strict=True):
        for leaf_a, leaf_b in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
            assert float(jnp.abs(leaf_b).max()) > 0, name  # every input gets a gradient
            np.testing.assert_allclose(leaf_a, leaf_b, rtol=1e-4, atol=1e-4 * float(jnp.abs(leaf_b).max()))


def _dots(jaxpr) -> list:
    """Every dot_general equation, nested jaxprs (loops, shard_map) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "dot_general":
            found.append(eqn)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            found += _dots(sub)
    return found


def test_blocks_multiply_one_experts_weights_at_a_time():
    """The dense path contracts against the whole ``[E, ...]`` expert stack; the blocks path only
    against one expert's 2-D weights, in a loop whose trip count is the number of occupied blocks."""
    x, idx, weights, experts = _problem(False, False)

    def ranks(impl):
        jaxpr = jax.make_jaxpr(lambda *a: expert_ffn(*a, in_first=False, activation=_swiglu, impl=impl))(
            x, idx, weights, experts)
        return {eqn.invars[1].aval.ndim for eqn in _dots(jaxpr.jaxpr)}, str(jaxpr)

    dense_ranks, _ = ranks(DENSE)
    block_ranks, text = ranks(BLOCKS)
    assert 3 in dense_ranks
    assert block_ranks == {2} and "while" in text


def test_block_size_bounds_padding():
    assert block_size(48, 4) == 8  # 48 rows over 4 experts: blocks of 8 rows
    assert block_size(8, 64) == 1  # decoding: one row per block
    assert block_size(1 << 20, 8) == MAX_BLOCK
    for rows, experts in ((4096, 64), (16384, 256), (300, 7)):
        block = block_size(rows, experts)
        assert block >= 2 and experts * (block - 1) <= rows  # padding never exceeds the real rows


def test_unknown_implementation_is_an_error():
    x, idx, weights, experts = _problem(False, False)
    with pytest.raises(ValueError, match="unknown MoE implementation"):
        expert_ffn(x, idx, weights, experts, in_first=False, activation=_swiglu, impl="capacity")


def test_bfloat16_experts_over_ep_compile_and_sum_in_float32_on_cpu():
    """In bfloat16 over ``ep`` the partial outputs are added in float32 on CPU (XLA:CPU's own
    widening of a 16-bit all-reduce aborted the process: "Invalid binary instruction opcode copy") and
    come back bfloat16,
    within bfloat16 rounding of the float32 result."""
    x, idx, weights, experts = _problem(True, True)
    ref = _dense_output(True, True)
    low = jax.tree.map(lambda a: a.astype(jnp.bfloat16), (x, weights, experts))
    with jax.set_mesh(make_mesh({"fsdp": 2, "ep": 4})):
        fn = jax.jit(lambda x, w, e: expert_ffn(x, idx, w, e, in_first=True, activation=_swiglu, impl=BLOCKS))
        jaxpr = str(jax.make_jaxpr(fn)(*low))
        got = fn(*low)
    assert got.dtype == jnp.bfloat16
    assert any("psum" in line and "f32[" in line for line in jaxpr.splitlines())
    scale = np.abs(ref).max()
    np.testing.assert_allclose(np.asarray(got, np.float32), ref, atol=0.05 * scale)
