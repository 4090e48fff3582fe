"""Forward time of a Gated DeltaNet layer (Qwen3.5's linear-attention mixer), a Mamba-2 layer
(Nemotron-H's) or a Kimi Delta Attention layer (Kimi-Linear's) over 2k-16k tokens: the chunked
recurrence otfload runs, against the same layer token by token and in the quadratic form, in one run.

    python -m benchmarks.bench_hybrid                          # 2k, 4k, 8k, 16k tokens
    python -m benchmarks.bench_hybrid --lengths 2048 4096 --repeat 5 --json out.json
    python -m benchmarks.bench_hybrid --layer mamba2
    python -m benchmarks.bench_hybrid --layer kda --quadratic-max 512

The layer is :func:`otfload.models.gated_delta.gated_delta_forward` with random float32 weights
(hidden 1024, 8 key heads and 16 value heads of 64 dims, a 4-tap conv), or with ``--layer mamba2``
:func:`otfload.models.mamba2.mamba2_forward` (hidden 1024, 32 heads of 32 dims in 4 groups, a state
of 64, a 4-tap conv), or with ``--layer kda`` :func:`otfload.models.kimi_delta.kda_forward` (hidden
1024, 8 heads of 64 dims, a 4-tap conv; its per-channel decays make the quadratic form build an
``[s, s, 64]`` factor per head, hence ``--quadratic-max 512``), one row, on the default device.
``chunked`` is the model's form (chunks of 64 tokens, Mamba-2's of 128, the state carried across
them); ``token`` the same layer with the recurrence one token per ``lax.scan`` step; ``quadratic``
the chunked code with one chunk as long as the sequence (an ``[s, s]`` system: the Gated DeltaNet's
solve is cubic, Mamba-2's product quadratic, so it runs up to ``--quadratic-max`` tokens). Each form
is compiled once, then the median of ``--repeat`` calls, in wall time and in the process's CPU time
(all of XLA's threads: on a machine shared with other work the wall time measures the neighbours
too); ``growth`` is a length's time over the previous length's (linear: 2.0 per doubling). Every
form's output is checked against the chunked one's.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from otfload.models import gated_delta, kimi_delta, mamba2
from otfload.models.gated_delta import gated_delta_forward


@dataclass(frozen=True)
class Shape:
    """A Qwen3.5-like linear-attention layer, scaled down to fit one CPU."""

    hidden_size: int = 1024
    linear_num_key_heads: int = 8
    linear_num_value_heads: int = 16
    linear_key_head_dim: int = 64
    linear_value_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6


def weights(seed: int) -> Callable[..., jax.Array]:
    """``w(*shape)``: random float32 weights of scale 0.02."""
    rng = np.random.default_rng(seed)
    return lambda *shape: jnp.asarray(rng.normal(0, 0.02, shape), jnp.float32)


def params(cfg: Shape, seed: int = 0) -> dict[str, Any]:
    w = weights(seed)
    h, hv, dv, c = cfg.hidden_size, cfg.linear_num_value_heads, cfg.linear_value_head_dim, gated_delta.conv_dim(cfg)
    return {"qkv": {"kernel": w(c, h)}, "conv": w(c, 1, cfg.linear_conv_kernel_dim) * 10,
            "z": {"kernel": w(hv, dv, h)}, "a": {"kernel": w(hv, h)}, "b": {"kernel": w(hv, h)},
            "dt_bias": w(hv), "A_log": jnp.log(jnp.linspace(1.0, 8.0, hv)), "norm": {"scale": 1 + w(dv)},
            "out": {"kernel": w(h, hv, dv)}}


def forms(
    cfg: Any, forward: Callable[..., tuple[jax.Array, Any]] = gated_delta_forward, chunk: int = gated_delta.CHUNK
) -> dict[str, Callable[[dict[str, Any], jax.Array], jax.Array]]:
    """``name -> layer(params, x)``: the same layer (``forward``) with its recurrence chunked
    (``chunk`` tokens), token by token, or in one chunk (the quadratic form)."""

    def form(size: int | None) -> Callable[[dict[str, Any], jax.Array], jax.Array]:
        def layer(p: dict[str, Any], x: jax.Array) -> jax.Array:
            return forward(p, x, cfg, None, None, chunk=x.shape[1] if size is None else size)[0]

        return layer

    return {"chunked": form(chunk), "token": form(0), "quadratic": form(None)}


@dataclass(frozen=True)
class Mamba2Shape:
    """A Nemotron-H-like Mamba-2 layer, scaled down to fit one CPU."""

    hidden_size: int = 1024
    mamba_num_heads: int = 32
    mamba_head_dim: int = 32
    n_groups: int = 4
    ssm_state_size: int = 64
    conv_kernel: int = 4
    use_conv_bias: bool = True
    use_bias: bool = False
    chunk_size: int = 128
    time_step_min: float = 0.001
    layer_norm_epsilon: float = 1e-5


def mamba2_params(cfg: Mamba2Shape, seed: int = 0) -> dict[str, Any]:
    w = weights(seed)
    h, heads, inner, c = cfg.hidden_size, cfg.mamba_num_heads, mamba2.inner_dim(cfg), mamba2.conv_dim(cfg)
    return {"in_proj": {"kernel": w(inner + c + heads, h)}, "conv": w(c, 1, cfg.conv_kernel) * 10,
            "conv_bias": w(c), "dt_bias": w(heads), "A_log": jnp.log(jnp.linspace(1.0, 8.0, heads)), "D": 1 + w(heads),
            "norm": {"scale": 1 + w(inner)}, "out_proj": {"kernel": w(h, inner)}}


@dataclass(frozen=True)
class KdaShape:
    """A Kimi-Linear-like KDA layer, scaled down to fit one CPU."""

    hidden_size: int = 1024
    linear_num_heads: int = 8
    linear_head_dim: int = 64
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-5


def kda_params(cfg: KdaShape, seed: int = 0) -> dict[str, Any]:
    w = weights(seed)
    h, n, d, k = cfg.hidden_size, cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_conv_kernel_dim
    return {**{x: {"kernel": w(n * d, h)} for x in ("q", "k", "v")},
            **{f"{x}_conv": w(n * d, 1, k) * 10 for x in ("q", "k", "v")},
            "f_a": {"kernel": w(d, h)}, "f_b": {"kernel": w(n * d, d)}, "dt_bias": w(n * d),
            "A_log": jnp.log(jnp.linspace(1.0, 8.0, n)).reshape(1, 1, n, 1), "b": {"kernel": w(n, h)},
            "g_a": {"kernel": w(d, h)}, "g_b": {"kernel": w(n * d, d)}, "norm": {"scale": 1 + w(d)},
            "o": {"kernel": w(h, n * d)}}


# --layer -> (its shape, its random parameters, its forms)
LAYERS: dict[str, tuple[Any, Callable[..., dict[str, Any]], Callable[..., dict[str, Any]]]] = {
    "gated_delta": (Shape, params, forms),
    "mamba2": (Mamba2Shape, mamba2_params, lambda cfg: forms(cfg, mamba2.mamba2_forward, cfg.chunk_size)),
    "kda": (KdaShape, kda_params, lambda cfg: forms(cfg, kimi_delta.kda_forward))}


def median_seconds(fn: Callable[..., jax.Array], args: tuple[Any, ...], repeat: int) -> tuple[float, float]:
    """The medians of ``repeat`` calls' wall and process CPU seconds (all of XLA's threads)."""
    wall, cpu = [], []
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        fn(*args).block_until_ready()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return float(np.median(wall)), float(np.median(cpu))


def run(lengths: list[int], repeat: int, quadratic_max: int, layer: str = "gated_delta") -> list[dict[str, Any]]:
    shape, make_params, make_forms = LAYERS[layer]
    cfg = shape()
    p = make_params(cfg)
    rows: list[dict[str, Any]] = []
    layers = make_forms(cfg)
    reference = jax.jit(layers["chunked"])
    for name, layer in layers.items():
        compiled = jax.jit(layer)
        previous: tuple[float, float] | None = None
        for s in lengths:
            if name == "quadratic" and s > quadratic_max:
                rows.append({"form": name, "tokens": s, "ms": None, "growth": None, "cpu_ms": None, "cpu_growth": None,
                             "max_abs_diff": None})
                continue
            x = jnp.asarray(np.random.default_rng(s).normal(size=(1, s, cfg.hidden_size)), jnp.float32)
            out = compiled(p, x).block_until_ready()  # compiled
            ref = out if name == "chunked" else reference(p, x)
            seconds, cpu = median_seconds(compiled, (p, x), repeat)
            rows.append({"form": name, "tokens": s, "ms": seconds * 1e3,
                         "growth": None if previous is None else seconds / previous[0],
                         "cpu_ms": cpu * 1e3, "cpu_growth": None if previous is None else cpu / previous[1],
                         "max_abs_diff": float(jnp.abs(out - ref).max())})
            previous = seconds, cpu
            print(json.dumps(rows[-1]), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| form | tokens | wall ms (median) | growth per doubling | CPU ms (median) | CPU growth | "
             "max abs diff / chunked |", "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        ms, cpu = ("not run", "") if r["ms"] is None else (f"{r['ms']:.1f}", f"{r['cpu_ms']:.1f}")
        growth = "" if r["growth"] is None else f"{r['growth']:.2f}x"
        cpu_growth = "" if r["cpu_growth"] is None else f"{r['cpu_growth']:.2f}x"
        diff = "" if r["max_abs_diff"] is None else f"{r['max_abs_diff']:.1e}"
        lines.append(f"| {r['form']} | {r['tokens']} | {ms} | {growth} | {cpu} | {cpu_growth} | {diff} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--repeat", type=int, default=3, help="timed calls per form and length (default: 3)")
    parser.add_argument("--quadratic-max", type=int, default=4096,
                        help="longest sequence the quadratic form runs on (default: 4096)")
    parser.add_argument("--layer", choices=sorted(LAYERS), default="gated_delta",
                        help="the mixer (default: gated_delta)")
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args(argv)
    rows = run(args.lengths, args.repeat, args.quadratic_max, args.layer)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"jax": jax.__version__, "device": str(jax.devices()[0]), "layer": args.layer, "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
