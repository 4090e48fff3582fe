"""Routed experts computed sparsely: every token runs through its top-k experts only.

The token-expert pairs (``T * k`` rows) are sorted by expert, each expert's rows go through that
expert's gated MLP as one grouped matmul, and the results are put back in token order and summed
with the routing weights. Exact: no token is dropped and there is no capacity factor.

Implementations (``impl``):

* ``"blocks"``: the sorted rows are laid out in blocks of ``block`` rows that each belong to one
  expert (each expert's run padded to a whole block), and a loop runs one block per step: one
  ``[block, hidden]`` matmul against one expert's weights. Work is ``T*k`` rows plus at most a
  block of padding per expert. The default where ``ragged_dot`` has no native kernel (CPU, where
  XLA lowers it to a masked dot against every expert).
* ``"ragged"``: ``jax.lax.ragged_dot_general``, one grouped matmul per projection; the default on
  GPU and TPU, whose XLA backends implement it natively.
* ``"dense"``: every expert on every token, weighted by routing weights that are zero outside the
  top k (the reference; benchmarks compare against it).

Expert parallelism: under a mesh with an ``ep`` axis (``jax.set_mesh(mesh)``; :func:`otfload.generate`
sets it), the experts are split over ``ep`` with ``shard_map``: tokens are replicated over ``ep``
(they are sharded on the batch axes), each ``ep`` shard computes the rows routed to its own experts
and a ``psum`` over ``ep`` adds the shards' partial outputs. The other mesh axes stay automatic.

Gradients: every implementation differentiates (``jax.grad`` jitted or not, with or without ``ep``).
``"blocks"`` loops over a data-dependent number of blocks, which reverse-mode autodiff cannot go
through, so it carries a custom VJP (see :func:`_block_loop`); the others are differentiated by JAX.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

BLOCKS, RAGGED, DENSE = "blocks", "ragged", "dense"
IMPLS = (BLOCKS, RAGGED, DENSE)
EP_AXIS = "ep"
# Largest block of rows one loop step multiplies: big enough that a [block, hidden] x [hidden, inter]
# matmul runs at full speed, small enough that per-expert padding (< block rows) stays cheap.
MAX_BLOCK = 128
# The block is about rows / (expert count * this), so padding (< one block per expert) costs at
# most 1/this of the real rows (about half that on average). 1 measured fastest on CPU (64 experts,
# top 4, 512 and 2048 tokens: blocks of 32 and 128 rows): a step also slices one expert's weights,
# so fewer, fuller blocks beat less padding.
PADDING_FRACTION = 1
# Backends whose XLA implements ragged_dot natively (elsewhere it becomes a dense masked dot).
RAGGED_BACKENDS = ("gpu", "tpu", "cuda", "rocm")

# The experts' activation of their input projections: ``(gate, up)``, or ``(up,)`` for experts without
# a gate (Nemotron-H's squared ReLU).
Activation = Callable[..., jax.Array]
# ``gate`` (optional), ``up`` and ``down``, each ``{"kernel": [E, ...], "bias": [E, out]}`` (bias optional).
Experts = Mapping[str, Mapping[str, jax.Array]]
INPUTS = ("gate", "up")


def default_impl() -> str:
    """``"ragged"`` on GPU/TPU, ``"blocks"`` elsewhere."""
    return RAGGED if jax.default_backend() in RAGGED_BACKENDS else BLOCKS


def block_size(rows: int, experts: int) -> int:
    """Rows per block for ``rows`` token-expert pairs over ``experts`` experts: a power of two near
    ``rows / (experts * PADDING_FRACTION)``, between 1 and :data:`MAX_BLOCK`."""
    target = max(1, rows // (experts * PADDING_FRACTION))
    return min(MAX_BLOCK, 1 << (target.bit_length() - 1))


def expert_ffn(
    x: jax.Array,
    idx: jax.Array,
    weights: jax.Array,
    experts: Experts,
    *,
    in_first: bool,
    activation: Activation,
    impl: str | None = None,
) -> jax.Array:
    """``sum_j weights[t, j] * expert_{idx[t, j]}(x[t])`` for ``x [T, hidden]``, ``idx``/``weights [T, k]``.

    ``experts`` holds ``gate``, ``up`` and ``down`` dicts with a ``kernel`` stacked on a leading
    experts axis (``[E, out, in]``, or ``[E, in, out]`` with ``in_first``) and optionally a ``bias``
    ``[E, out]``; an expert computes ``down(activation(gate(x), up(x)))``, or ``down(activation(up(x)))``
    without ``gate``. Returns ``x``'s dtype.
    """
    impl = impl or default_impl()
    if impl not in IMPLS:
        raise ValueError(f"unknown MoE implementation {impl!r}; expected one of {IMPLS}")
    num_experts = experts["up"]["kernel"].shape[0]
    if impl == DENSE:
        return _dense(x, idx, weights, experts, num_experts, in_first, activation)
    mesh = jax.sharding.get_abstract_mesh()
    ep = dict(mesh.shape).get(EP_AXIS, 1) if not mesh.empty else 1
    if ep == 1 or num_experts % ep:
        return _routed(x, idx, weights, experts, 0, in_first, activation, impl)

    # XLA:CPU widens a 16-bit all-reduce to float32 itself, and its pass (AllReducePromotion, jaxlib
    # 0.10.2) aborts the process on the reducer this psum lowers to ("Invalid binary instruction
    # opcode copy": every MoE in bfloat16 on an ep mesh): on CPU the sum is taken in float32 here,
    # the same bytes and arithmetic as the pass's; other backends keep the collective's own dtype.
    promote = jax.default_backend() == "cpu" and jnp.dtype(x.dtype).itemsize < 4

    def local(x: jax.Array, idx: jax.Array, weights: jax.Array, experts: Experts) -> jax.Array:
        first = jax.lax.axis_index(EP_AXIS) * (num_experts // ep)
        out = _routed(x, idx, weights, experts, first, in_first, activation, impl)
        wide = out.astype(jnp.float32) if promote else out
        summed: jax.Array = jax.lax.psum(wide, EP_AXIS)  # type: ignore[no-untyped-call]  # unannotated in jax
        return summed.astype(out.dtype)

    # jax's PartitionSpec.__init__ is unannotated.
    expert_specs = jax.tree.map(lambda _: P(EP_AXIS), experts)  # type: ignore[no-untyped-call]
    replicated = P()  # type: ignore[no-untyped-call]
    split = jax.shard_map(local, mesh=mesh, in_specs=(replicated, replicated, replicated, expert_specs),
                          out_specs=replicated, axis_names={EP_AXIS}, check_vma=False)
    # Under jit: run eagerly (op by op, as an un-jitted ``jax.grad`` runs it), a shard_map over
    # some of the mesh's axes fails to differentiate (its partial evaluation gives residuals specs
    # naming the automatic axes: "out_specs ... must refer to an axis marked as manual").
    out: jax.Array = jax.jit(split)(x, idx, weights, experts)
    return out


def _activated(experts: Experts, proj: Callable[[str], jax.Array], activation: Activation) -> jax.Array:
    """``activation`` of the input projections ``proj(name)`` the experts have (gate and up, or up)."""
    return activation(*(proj(name) for name in INPUTS if name in experts))


def _project(kernel: jax.Array, bias: jax.Array | None, x: jax.Array, in_first: bool) -> jax.Array:
    """One expert's projection of rows ``x [n, in]`` (``kernel`` is that expert's 2-D weight)."""
    y = x @ kernel if in_first else x @ kernel.T
    return y if bias is None else y + bias


def _dense(
    x: jax.Array, idx: jax.Array, weights: jax.Array, experts: Experts, num_experts: int, in_first: bool,
    activation: Activation,
) -> jax.Array:
    """Every expert on every token; routing weights zero outside the top k."""
    dense_w = jnp.sum(jax.nn.one_hot(idx, num_experts, dtype=jnp.float32) * weights[..., None], axis=-2)
    up_spec, down_spec = ("th,ehm->tem", "tem,emh->teh") if in_first else ("th,emh->tem", "tem,ehm->teh")

    def proj(p: Mapping[str, jax.Array], h: jax.Array, spec: str) -> jax.Array:
        y = jnp.einsum(spec, h, p["kernel"])
        return y + p["bias"] if "bias" in p else y

    act = _activated(experts, lambda name: proj(experts[name], x, up_spec), activation)
    out = proj(experts["down"], act, down_spec)
    return jnp.einsum("teh,te->th", out, dense_w.astype(out.dtype))


def _routed(
    x: jax.Array, idx: jax.Array, weights: jax.Array, experts: Experts, first: int | jax.Array, in_first: bool,
    activation: Activation, impl: str,
) -> jax.Array:
    """The rows routed to experts ``first .. first + E_local - 1`` (the experts held here), sorted
    by expert, through a grouped matmul, then weighted back into token order (f32 sum over k)."""
    tokens, k = idx.shape
    local_experts = experts["up"]["kernel"].shape[0]
    local = idx - first
    held = (local >= 0) & (local < local_experts)
    bucket = jnp.where(held, local, local_experts).reshape(-1)  # the last bucket: experts held elsewhere
    order = jnp.argsort(bucket, stable=True)
    sizes = jnp.bincount(bucket, length=local_experts + 1)[:local_experts]
    rows = x[order // k]
    if impl == RAGGED:
        ys = _ragged(rows, sizes, experts, in_first, activation)
    else:
        ys = _blocks(rows, sizes, experts, in_first, activation)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(tokens, k, -1)
    w = jnp.where(held, weights, 0.0).astype(jnp.float32)
    y = jnp.where(held[..., None], y, 0).astype(jnp.float32)
    return jnp.einsum("tkh,tk->th", y, w).astype(x.dtype)


def _expert_of_rows(sizes: jax.Array, rows: int) -> jax.Array:
    """The expert each sorted row belongs to (``len(sizes)`` for rows past the last group)."""
    return jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(rows), side="right")


def _ragged(rows: jax.Array, sizes: jax.Array, experts: Experts, in_first: bool, activation: Activation) -> jax.Array:
    contract = 1 if in_first else 2
    dims = jax.lax.RaggedDotDimensionNumbers(  # type: ignore[no-untyped-call]  # unannotated in jax
        dot_dimension_numbers=(([1], [contract]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0]
    )
    expert = jnp.minimum(_expert_of_rows(sizes, rows.shape[0]), sizes.shape[0] - 1)

    def proj(p: Mapping[str, jax.Array], h: jax.Array) -> jax.Array:
        y = jax.lax.ragged_dot_general(h, p["kernel"], sizes, dims, preferred_element_type=h.dtype)
        return y + p["bias"][expert] if "bias" in p else y

    return proj(experts["down"], _activated(experts, lambda name: proj(experts[name], rows), activation))


def _blocks(rows: jax.Array, sizes: jax.Array, experts: Experts, in_first: bool, activation: Activation) -> jax.Array:
    """Grouped matmul by expert-homogeneous blocks, one loop step per occupied block."""
    n, hidden = rows.shape
    num_experts = sizes.shape[0]
    block = block_size(n, num_experts)
    padded = (sizes + block - 1) // block * block
    starts, padded_starts = jnp.cumsum(sizes) - sizes, jnp.cumsum(padded) - padded
    expert = _expert_of_rows(sizes, n)
    in_group = expert < num_experts
    e = jnp.minimum(expert, num_experts - 1)
    # At most one partly filled block per expert that has rows (at most min(E, n) of them).
    max_blocks = -(-n // block) + min(num_experts, n)
    slot = jnp.where(in_group, padded_starts[e] + jnp.arange(n) - starts[e], max_blocks * block)
    laid_out = jnp.zeros((max_blocks * block, hidden), rows.dtype).at[slot].set(rows, mode="drop")
    block_ends = jnp.cumsum(padded) // block
    block_expert = jnp.minimum(jnp.searchsorted(block_ends, jnp.arange(max_blocks), side="right"), num_experts - 1)
    out = _block_loop(block, in_first, activation)(laid_out, block_expert, block_ends[-1], experts)
    return out.at[slot].get(mode="fill", fill_value=0)


BlockLoop = Callable[[jax.Array, jax.Array, jax.Array, Experts], jax.Array]


def _block_loop(block: int, in_first: bool, activation: Activation) -> BlockLoop:
    """``loop(laid_out, block_expert, count, experts)``: blocks ``0 .. count - 1`` of ``block`` rows
    of ``laid_out`` each through expert ``block_expert[j]``'s MLP (rows past them stay zero).

    The trip count is data (the occupied blocks), so the loop is a ``while`` that reverse-mode
    autodiff cannot differentiate; its gradient is given by a custom VJP instead: a second loop over
    the same blocks recomputes each block's MLP (nothing is saved per block: the residuals are the
    inputs) and takes its VJP, writing the rows' cotangents in place and adding each weight
    cotangent into its expert's slice of the weights' cotangent."""

    def mlp(h: jax.Array, w: Mapping[str, Mapping[str, jax.Array]]) -> jax.Array:
        def proj(name: str, v: jax.Array) -> jax.Array:
            return _project(w[name]["kernel"], w[name].get("bias"), v, in_first)

        return proj("down", _activated(w, lambda name: proj(name, h), activation))

    def rows_of(a: jax.Array, j: jax.Array) -> jax.Array:
        return jax.lax.dynamic_slice_in_dim(a, j * block, block)

    def expert(experts: Experts, i: jax.Array) -> Experts:
        one: Experts = jax.tree.map(lambda a: a[i], experts)
        return one

    def forward(laid_out: jax.Array, block_expert: jax.Array, count: jax.Array, experts: Experts) -> jax.Array:
        def step(j: jax.Array, out: jax.Array) -> jax.Array:
            y = mlp(rows_of(laid_out, j), expert(experts, block_expert[j]))
            return jax.lax.dynamic_update_slice_in_dim(out, y.astype(out.dtype), j * block, 0)

        out: jax.Array = jax.lax.fori_loop(0, count, step, jnp.zeros_like(laid_out))
        return out

    loop = jax.custom_vjp(forward)

    def fwd(*args: Any) -> tuple[jax.Array, tuple[Any, ...]]:
        return forward(*args), args

    def bwd(res: tuple[Any, ...], g: jax.Array) -> tuple[jax.Array, None, None, Experts]:
        laid_out, block_expert, count, experts = res

        def step(j: jax.Array, acc: tuple[jax.Array, Experts]) -> tuple[jax.Array, Experts]:
            d_rows, d_experts = acc
            i = block_expert[j]
            _, vjp = jax.vjp(mlp, rows_of(laid_out, j), expert(experts, i))
            dh, dw = vjp(rows_of(g, j).astype(laid_out.dtype))
            d_rows = jax.lax.dynamic_update_slice_in_dim(d_rows, dh, j * block, 0)
            return d_rows, jax.tree.map(lambda a, d: a.at[i].add(d), d_experts, dw)

        zeros = (jnp.zeros_like(laid_out), jax.tree.map(jnp.zeros_like, experts))
        d_rows, d_experts = jax.lax.fori_loop(0, count, step, zeros)
        return d_rows, None, None, d_experts

    loop.defvjp(fwd, bwd)
    return loop
