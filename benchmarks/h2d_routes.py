"""Host-to-accelerator copy routes: where a GPU load's time goes once the bytes are in host memory.

    python -m benchmarks.h2d_routes [--gib 2] [--routes whole,pieces-64m,...]

On an H200 ``jax.device_put`` of pageable numpy memory moved 1.5 GB/s while torch copied the same
bytes from pinned memory at 54 GB/s (``bench_load --platform gpu``, docs/benchmarks.md). Each route
here copies one ``--gib`` numpy array (in memory, no disk) to the first device, in a fresh process,
twice (the first call pays one-time set-up such as JAX growing its pinned staging pool; the second
shows the steady rate), and reports both rates and the process's RSS growth. Routes that need a
library or memory kind the machine lacks are reported and skipped.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from benchmarks import harness

MIB = 2**20
ROUTES = (
    "numpy-copy,whole,pieces-16m,pieces-64m,pieces-256m,pieces-64m-inflight,threads-4x64m,"
    "pieces-64m-freed,pieces-64m-written,torch-pageable,torch-pin"
)


def _pieces(x: np.ndarray, piece_bytes: int) -> list[np.ndarray]:
    rows = max(1, piece_bytes // (x.nbytes // x.shape[0]))
    return [x[r : r + rows] for r in range(0, x.shape[0], rows)]


def _route(name: str, x: np.ndarray) -> Callable[[], object]:
    """A function copying ``x`` to the first device by route ``name`` and waiting for it."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]

    def pieces(piece_bytes: int, inflight: bool = False) -> Callable[[], object]:
        def run():
            parts = []
            for piece in _pieces(x, piece_bytes):
                parts.append(jax.device_put(piece, device))
                if not inflight:
                    parts[-1].block_until_ready()
            return jnp.concatenate(parts).block_until_ready()

        return run

    def freed(piece_bytes: int) -> Callable[[], object]:
        """Each piece copied, waited for and dropped at once: nothing assembled (does JAX's staging
        memory follow the pieces alive, or stay once grown?)."""

        def run():
            for piece in _pieces(x, piece_bytes):
                jax.device_put(piece, device).block_until_ready().delete()

        return run

    def written(piece_bytes: int) -> Callable[[], object]:
        """Each piece copied, then written into one preallocated device buffer (donated
        ``dynamic_update_slice``, one compiled function) and dropped."""
        rows = _pieces(x, piece_bytes)[0].shape[0]
        put = jax.jit(
            lambda buf, part, r: jax.lax.dynamic_update_slice(buf, part, (r, 0)), donate_argnums=0
        )

        def run():
            buf = jnp.zeros(x.shape, x.dtype, device=device)
            for r in range(0, x.shape[0], rows):
                piece = x[r : r + rows]
                if piece.shape[0] != rows:  # a short last piece: written where a whole one ends
                    r, piece = x.shape[0] - rows, x[x.shape[0] - rows :]
                buf = put(buf, jax.device_put(piece, device), r)
            return buf.block_until_ready()

        return run

    def threads(n: int, piece_bytes: int) -> Callable[[], object]:
        def run():
            quarters = np.array_split(np.arange(x.shape[0]), n)

            def copy(rows: np.ndarray) -> list:
                part = x[rows[0] : rows[-1] + 1]
                return [jax.device_put(p, device).block_until_ready() for p in _pieces(part, piece_bytes)]

            with ThreadPoolExecutor(n) as pool:
                parts = [p for ps in pool.map(copy, quarters) for p in ps]
            return jnp.concatenate(parts).block_until_ready()

        return run

    def torch_copy(pin: bool) -> Callable[[], object]:
        import torch

        t = torch.from_numpy(x)

        def run():
            out = (t.pin_memory() if pin else t).to("cuda")
            torch.cuda.synchronize()
            return out

        return run

    routes: dict[str, Callable[[], Callable[[], object]]] = {
        "numpy-copy": lambda: lambda: x.copy(),
        "whole": lambda: lambda: jax.device_put(x, device).block_until_ready(),
        "pieces-16m": lambda: pieces(16 * MIB),
        "pieces-64m": lambda: pieces(64 * MIB),
        "pieces-256m": lambda: pieces(256 * MIB),
        "pieces-64m-inflight": lambda: pieces(64 * MIB, inflight=True),
        "threads-4x64m": lambda: threads(4, 64 * MIB),
        "pieces-64m-freed": lambda: freed(64 * MIB),
        "pieces-64m-written": lambda: written(64 * MIB),
        "torch-pageable": lambda: torch_copy(pin=False),
        "torch-pin": lambda: torch_copy(pin=True),  # pinning the memory, then the copy: both timed
    }
    return routes[name]()


def child(name: str, gib: float) -> dict:
    import psutil

    x = np.full((int(gib * 1024), MIB // 2), 7, np.uint16)  # rows of 1 MiB
    run = _route(name, x)
    rss = psutil.Process().memory_info().rss
    times = []
    for _ in range(2):
        start = time.perf_counter()
        out = run()
        times.append(time.perf_counter() - start)
        del out
    grown = psutil.Process().memory_info().rss - rss
    return {"route": name, "bytes": x.nbytes, "seconds": times, "rss_growth": grown}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=2.0)
    parser.add_argument("--routes", default=ROUTES)
    parser.add_argument("--json", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        harness.report(child(args.child, args.gib))
        return
    rows: list[list[object]] = []
    results = []
    for name in args.routes.split(","):
        try:
            r = harness.run_child("benchmarks.h2d_routes", ["--child", name, "--gib", str(args.gib)], what=name)
        except RuntimeError as e:
            rows.append([name, f"failed: {str(e).strip().splitlines()[-1][:100]}", "", "", "", ""])
            continue
        results.append(r)
        (a, b), gb = r["seconds"], r["bytes"] / 1e9
        rows.append([name, f"{a:.3f}", f"{gb / a:.2f}", f"{b:.3f}", f"{gb / b:.2f}", f"{r['rss_growth'] / 2**30:.2f}"])
        print(f"{name}: {a:.3f} s, then {b:.3f} s", file=sys.stderr, flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(harness.table(["route", "first call s", "GB/s", "second call s", "GB/s", "RSS growth GiB"], rows))


if __name__ == "__main__":
    main()
