"""Building blocks shared by the reference models: parameters with logical axes (dense, per-expert),
norms, RoPE. Layer math is written as pure functions of parameter dicts so one function serves
scanned (``jax.lax.scan`` over stacked params) and unscanned (a Python loop) models.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.typing import DTypeLike

from otfload.models.weights import materialize

# One module's parameters as a pure pytree: nested dicts (``{"attn": {"q": {"kernel": ...}}}``) whose
# depth varies by key, with arrays (or stored weights) at the leaves; hence values typed Any.
Params = Mapping[str, Any]
# A pytree of arrays (a layer's cache, its attention type, ...): any nesting of tuples and dicts.
Tree = Any


class ParamOptions(TypedDict):
    """The keyword arguments every parameter module passes on to its parts (``**kw``)."""

    dtype: DTypeLike
    rngs: nnx.Rngs | None
    stack: int | None


def make_param(
    rngs: nnx.Rngs | None, shape: Sequence[int], axes: Sequence[str | None], dtype: DTypeLike,
    stack: int | None = None,
) -> nnx.Param[jax.Array]:
    """A normally initialised ``nnx.Param`` annotated with ``logical_axes``; ``stack`` prepends a
    ``layers`` axis (scanned models). ``rngs=None`` gives zeros: an abstract model (built under
    ``nnx.eval_shape`` to be planned, then loaded) draws no random numbers, whose traced key splits
    made planning quadratic in the number of parameters (DeepSeek-V3 unscanned: minutes)."""
    shape, axes = tuple(shape), tuple(axes)
    if stack is not None:
        shape, axes = (stack, *shape), ("layers", *axes)
    if rngs is None:
        return nnx.Param(jnp.zeros(shape, dtype), logical_axes=axes)
    value = jax.random.normal(rngs.params(), shape, jnp.float32) * 0.02
    return nnx.Param(value.astype(dtype), logical_axes=axes)


class Dense(nnx.Module):
    """A weight ``kernel`` of ``shape`` and, when ``bias_dims`` names any, a ``bias`` over those
    kernel dims (its output dims).

    Reference models lay kernels out as HF stores them, output dims first and input dims last
    (``q``: ``(heads, head_dim, hidden)``), so loading is a copy and a reshape, never a transpose;
    ``bias_dims=(0, 1)`` then gives ``q`` a ``(heads, head_dim)`` bias.
    """

    def __init__(
        self, shape: Sequence[int], axes: Sequence[str | None], *, bias_dims: Sequence[int] = (), dtype: DTypeLike,
        rngs: nnx.Rngs | None, stack: int | None = None,
    ) -> None:
        self.kernel = make_param(rngs, shape, axes, dtype, stack)
        if bias_dims:
            self.bias = make_param(rngs, [shape[d] for d in bias_dims], [axes[d] for d in bias_dims], dtype, stack)


class ExpertDense(Dense):
    """Per-expert weights on a leading experts axis. ``shape``/``axes`` are ``(out, in)``; the kernel is
    ``[E, out, in]``, or ``[E, in, out]`` with ``in_first``; the optional bias is ``[E, out]``."""

    def __init__(
        self, num_experts: int, shape: tuple[int, int], axes: tuple[str | None, str | None], *, bias: bool,
        in_first: bool = False, dtype: DTypeLike, rngs: nnx.Rngs | None, stack: int | None = None,
    ) -> None:
        (out, inp), (out_axis, in_axis) = shape, axes
        if in_first:
            dims, names, out_dim = (inp, out), (in_axis, out_axis), 2
        else:
            dims, names, out_dim = (out, inp), (out_axis, in_axis), 1
        super().__init__((num_experts, *dims), ("experts", *names), bias_dims=(0, out_dim) if bias else (),
                         dtype=dtype, rngs=rngs, stack=stack)


class Norm(nnx.Module):
    """An RMSNorm ``scale`` of ``dim`` values, or of the ``shape`` with ``axes`` a norm over several
    dims keeps (a q norm over every head: ``(heads, head_dim)``)."""

    def __init__(
        self, dim: int | tuple[int, ...], axes: tuple[str, ...] = ("norm",), *, dtype: DTypeLike,
        rngs: nnx.Rngs | None, stack: int | None = None,
    ) -> None:
        self.scale = make_param(rngs, (dim,) if isinstance(dim, int) else dim, axes, dtype, stack)


class Embed(nnx.Module):
    def __init__(self, vocab: int, dim: int, *, dtype: DTypeLike, rngs: nnx.Rngs | None) -> None:
        self.embedding = make_param(rngs, (vocab, dim), ("vocab", "embed"), dtype)


def pure(module: nnx.Module) -> dict[str, Any]:
    """The module's parameters as a nested dict of arrays (what the pure layer functions take)."""
    return nnx.to_pure_dict(nnx.state(module, nnx.Param))


def run_layers(
    params: Params | Sequence[Params],
    x: jax.Array,
    forward: Callable[[Params, jax.Array, Tree], tuple[jax.Array, Tree]],
    xs: Tree = None,
) -> tuple[jax.Array, Tree]:
    """``x`` through every layer: ``forward(p, x, xs_i) -> (x, y_i)`` scanned (``jax.lax.scan``)
    over stacked parameters (a dict whose leaves have a leading ``layers`` axis) or looped over a
    list of per-layer dicts; ``xs`` (a pytree with a leading layer axis, or None) gives each layer
    its slice (a layer's cache, its attention type). Returns ``(x, ys)``, the ``y_i`` stacked on a
    leading layer axis (None when every ``y_i`` is None). Stored weights
    (:mod:`otfload.models.weights`) are materialized one layer at a time."""
    if isinstance(params, Mapping):
        return jax.lax.scan(lambda h, p_xs: forward(materialize(p_xs[0]), h, p_xs[1]), x, (params, xs))
    ys = []
    for i, p in enumerate(params):
        x, y = forward(materialize(p), x, jax.tree.map(lambda a, i=i: a[i], xs))
        ys.append(y)
    return x, (None if all(y is None for y in ys) else jax.tree.map(lambda *a: jnp.stack(a), *ys))


def rms_norm(x: jax.Array, scale: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm computed in float32, scaled by ``offset + scale`` (Gemma uses offset 1)."""
    x32 = x.astype(jnp.float32)
    x32 = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
    return (x32.astype(x.dtype) * (offset + scale.astype(jnp.float32)).astype(x.dtype)).astype(x.dtype)


def rms_norm_scaled_f32(x: jax.Array, scale: jax.Array, eps: float) -> jax.Array:
    """RMSNorm whose scale multiplies the float32 normalised values before the one cast back to
    ``x``'s dtype (OLMo's order; :func:`rms_norm` casts, then multiplies, as Llama does)."""
    return rms_norm(x.astype(jnp.float32), scale, eps).astype(x.dtype)


def dense(p: Params, x: jax.Array, spec: str) -> jax.Array:
    """``einsum(spec, x, kernel) + bias``."""
    y = jnp.einsum(spec, x, p["kernel"])
    return y + p["bias"] if "bias" in p else y


def rope_inv_freq(head_dim: int, theta: float, scaling: Mapping[str, Any] | None) -> np.ndarray:
    """Inverse frequencies for RoPE, including Llama 3 ``rope_type="llama3"`` scaling."""
    inv = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    scaling = scaling or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "llama3":
        factor = scaling["factor"]
        low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_ctx = scaling["original_max_position_embeddings"]
        wavelen = 2 * math.pi / inv
        scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low) if high > low else np.zeros_like(wavelen)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_ctx / high) & (wavelen <= old_ctx / low)
        inv = np.where(medium, smoothed, scaled)
    elif kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "yarn":
        inv = _yarn_inv_freq(inv, head_dim, theta, scaling)
    elif kind not in ("default", None):
        raise NotImplementedError(f"rope_type {kind!r}")
    return inv.astype(np.float32)


def _yarn_inv_freq(inv: np.ndarray, head_dim: int, theta: float, scaling: Mapping[str, Any]) -> np.ndarray:
    """YaRN: interpolate low frequencies by ``factor``, keep high ones, blend linearly between the
    ``beta_fast``/``beta_slow`` correction dims (transformers' ``_compute_yarn_parameters``)."""
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(scaling.get("beta_fast") or 32), correction_dim(scaling.get("beta_slow") or 1)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    ramp = np.clip((np.arange(head_dim // 2) - low) / ((high + 0.001 if low == high else high) - low), 0, 1)
    blended: np.ndarray = inv / factor * ramp + inv * (1 - ramp)
    return blended


def yarn_mscale(factor: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction ``0.1 m ln(factor) + 1`` (1 without scaling)."""
    return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0


def rope_attention_factor(scaling: Mapping[str, Any] | None) -> float:
    """The factor YaRN multiplies cos/sin by (``attention_factor`` or ``0.1 ln(factor) + 1``); 1 otherwise."""
    scaling = scaling or {}
    if scaling.get("rope_type", scaling.get("type")) != "yarn":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor, m, m_all = scaling["factor"], scaling.get("mscale"), scaling.get("mscale_all_dim")
    return yarn_mscale(factor, m) / yarn_mscale(factor, m_all) if m and m_all else yarn_mscale(factor)


def rope_tables(positions: jax.Array, inv_freq: np.ndarray, scale: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """``(cos, sin)`` of ``positions x inv_freq``, each times ``scale`` (see :func:`rope_attention_factor`)."""
    freqs = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb) * scale, jnp.sin(emb) * scale


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x [batch, seq, heads, head_dim]`` (the rotate-half convention of HF checkpoints).

    Partial rotary (tables narrower than ``head_dim``: ``partial_rotary_factor``) rotates the first
    ``cos.shape[-1]`` dims of each head and passes the rest through."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]], axis=-1)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    cos, sin = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
    return x * cos + rotated * sin
