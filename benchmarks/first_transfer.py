"""Where a fresh process's first host-to-device transfer spends its time (issue 30 §1).

    python -m benchmarks.first_transfer [--variants default,eager-modules,no-prealloc,platform-alloc,compute-first]

On an H200 the first ``jax.device_put`` of a process took ~1.5-2 s whatever its size. Each variant
runs in a fresh process and times, one after another: ``import jax``; ``jax.devices()`` (the client
and its devices); the first transfer of one byte; a second one-byte transfer; a 256 MiB transfer.
The variants change one suspect each:

* ``default``: as a user's process;
* ``eager-modules``: ``CUDA_MODULE_LOADING=EAGER`` (the driver loads every kernel module up front, at
  client creation, instead of on first use);
* ``no-prealloc``: ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` (no 75 % device memory pool reserved at
  start);
* ``platform-alloc``: ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` (no device memory pool at all);
* ``compute-first``: a small on-device computation (``jnp.zeros(1)``) before the first transfer: if
  the transfer's cost moves to it, the cost is the device's lazy set-up, not the copy path.

A cost that stays with the first transfer in every variant is the copy path's own (host staging
allocator, transfer streams); the load then starts it early (:mod:`otfload.place.warmup`).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from benchmarks import harness

VARIANTS = {
    "default": {},
    "eager-modules": {"CUDA_MODULE_LOADING": "EAGER"},
    "no-prealloc": {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"},
    "platform-alloc": {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"},
    "compute-first": {},
}
BIG_BYTES = 256 << 20


def child(compute_first: bool) -> dict[str, float]:
    """The phases' seconds in this (fresh) process."""
    out: dict[str, float] = {}
    start = time.perf_counter()

    def mark(name: str) -> None:
        nonlocal start
        now = time.perf_counter()
        out[name] = now - start
        start = now

    import numpy as np

    one, big = np.zeros(1, np.uint8), np.ones(BIG_BYTES, np.uint8)  # made before any timer
    start = time.perf_counter()
    import jax
    import jax.numpy as jnp

    mark("import jax")
    device = jax.devices()[0]
    mark("jax.devices()")
    if compute_first:
        jnp.zeros(1, device=device).block_until_ready()
        mark("first computation")
    jax.device_put(one, device).block_until_ready()
    mark("first 1-byte put")
    jax.device_put(one, device).block_until_ready()
    mark("second 1-byte put")
    jax.device_put(big, device).block_until_ready()
    mark("256 MiB put")
    out["platform"] = device.platform  # type: ignore[assignment]
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.child:
        harness.report(child(args.child == "compute-first"))
        return
    rows = {}
    for name in args.variants.split(","):
        try:
            rows[name] = harness.run_child("benchmarks.first_transfer", ["--child", name], env=VARIANTS[name],
                                           timeout=120, what=name)  # fmt: skip
        except RuntimeError as e:
            print(f"{name}: failed: {str(e).strip().splitlines()[-1:]}", file=sys.stderr)
    phases = list(dict.fromkeys(k for r in sorted(rows.values(), key=len, reverse=True) for k in r if k != "platform"))
    cells = [[name, r["platform"], *(f"{r[p]:.3f}" if p in r else "" for p in phases)] for name, r in rows.items()]
    print(harness.table(["variant", "platform", *(f"{p} s" for p in phases)], cells, left=2))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
