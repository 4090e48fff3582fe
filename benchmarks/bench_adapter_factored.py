"""Separate LoRA factors (``merge_adapter=False``) vs the adapter merged on load: load time, bytes, and
the cost of the forward pass that merges one layer at a time.

    python -m benchmarks.bench_adapter_factored --size-gib 0.25 [--rank 16] [--tokens 128] [--repeat 5]

The bf16 Llama-shaped checkpoint and rank-``--rank`` all-projection adapter of
``benchmarks.bench_adapter`` (written first if missing). In one process on ``--devices`` simulated
CPU devices (the 2×4 mesh of bench_load), for each of ``merged`` and ``factored``: one load
(``from_pretrained``; wall seconds, ``LoadReport.bytes_read``), then a jitted forward on
``[1, --tokens]`` token ids (compiled once, median of ``--repeat`` runs). For ``factored`` also one
jitted training step that differentiates the factors only (``lora_factors`` /
``with_lora_factors``) and the max relative difference of its logits from the merged model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from benchmarks import harness

GIB = harness.GIB


def timed(fn, repeat: int) -> float:
    """Median seconds of ``fn()`` (blocked until ready) over ``repeat`` runs after one warm-up."""
    import jax

    return statistics.median(harness.times(lambda: jax.block_until_ready(fn()), repeat))


def train_step_seconds(model, ids, repeat: int) -> tuple[int, float]:
    """``(factor elements, median seconds)`` of a jitted SGD step on the factors only."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from otfload.adapters import lora_factors, with_lora_factors

    graphdef, state = nnx.split(model)

    def loss(factors):
        out = nnx.merge(graphdef, with_lora_factors(state, factors))(ids)
        return jnp.mean(jax.nn.logsumexp(out.astype(jnp.float32), axis=-1))

    @jax.jit
    def step(factors):
        grads = jax.grad(loss)(factors)
        return jax.tree.map(lambda p, g: p - 1e-3 * g, factors, grads)

    factors = lora_factors(state)
    count = sum(x.size for f in factors for x in f.values())
    return count, timed(lambda: step(factors), repeat)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args(argv)
    harness.simulate_cpu_devices(args.devices)

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import otfload
    from benchmarks.bench_adapter import adapter_dir, write_lora
    from benchmarks.make_checkpoint import ensure_checkpoint
    from benchmarks.target import bench_mesh

    print(harness.machine_line())
    base = ensure_checkpoint(args.size_gib, out=args.dir)
    adapter = write_lora(base, adapter_dir(base, args.rank), args.rank)
    mesh = bench_mesh(args.devices)
    vocab = int(json.loads((base / "config.json").read_text())["vocab_size"])
    ids = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (1, args.tokens)))
    forward = nnx.jit(lambda m, x: m(x))
    logits = {}
    for method in ("merged", "factored"):
        start = time.perf_counter()
        model, report = otfload.from_pretrained(base, adapter=adapter, merge_adapter=method == "merged", mesh=mesh,
                                                progress=False, return_report=True)
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))
        load = time.perf_counter() - start
        step = timed(lambda model=model: forward(model, ids), args.repeat)
        logits[method] = np.asarray(forward(model, ids), np.float32)
        print(f"{method:8s} load {load:6.2f} s  read {report.bytes_read / GIB:.3f} GiB  "
              f"forward [1, {args.tokens}] {step * 1e3:8.1f} ms")
        if method == "factored":
            count, seconds = train_step_seconds(model, ids, args.repeat)
            print(f"factored train step (factor gradients only, {count / 1e6:.1f} M factor elements) "
                  f"{seconds * 1e3:8.1f} ms")
        del model
    diff = np.abs(logits["factored"] - logits["merged"]).max() / np.abs(logits["merged"]).max()
    print(f"factored vs merged logits (bf16 model): max relative difference {diff:.2e}")


if __name__ == "__main__":
    main()
