"""Peak host memory and time of ``export_hf`` for a ≥ 1 GiB bf16 Llama loaded on a 2x4 mesh.

Usage: python -m benchmarks.bench_export [--size-gib 1.0] [--unscanned]

The checkpoint comes from ``benchmarks.make_checkpoint`` (written once into bench_data/). The model
is loaded with ``otfload.from_pretrained`` on 8 simulated CPU devices (so the loaded weights
themselves live in this process: the baseline); RSS is sampled every 5 ms during the export and
the transient (peak minus baseline) is compared with the largest HF tensor and the largest leaf.
The export is then checked bit-exact against the source, one tensor at a time.
"""

from __future__ import annotations

from benchmarks import harness

harness.simulate_cpu_devices(8)

import argparse  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
from safetensors import safe_open  # noqa: E402

import otfload  # noqa: E402
from benchmarks.make_checkpoint import ensure_checkpoint  # noqa: E402
from benchmarks.target import bench_mesh  # noqa: E402
from otfload.export import export_hf  # noqa: E402
from otfload.export.gather import leaf_arrays  # noqa: E402
from otfload.index.checkpoint import open_index  # noqa: E402
from otfload.sources import open_source  # noqa: E402

MIB = 2**20


def _tensors(directory: Path) -> dict[str, Path]:
    files = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(path, "np") as f:
            files.update(dict.fromkeys(f.keys(), path))
    return files


def _bit_exact(a: Path, b: Path) -> bool:
    ta, tb = _tensors(a), _tensors(b)
    if ta.keys() != tb.keys():
        return False
    for key in ta:
        with safe_open(ta[key], "np") as fa, safe_open(tb[key], "np") as fb:
            x, y = fa.get_tensor(key), fb.get_tensor(key)
            if x.dtype != y.dtype or not np.array_equal(x.view(np.uint8), y.view(np.uint8)):
                return False
    return True


def run(size_gib: float, scan_layers: bool) -> dict:
    src = ensure_checkpoint(size_gib)
    model = otfload.from_pretrained(src, mesh=bench_mesh(), scan_layers=scan_layers)
    leaves = leaf_arrays(model)
    index = open_index(open_source(src))
    largest_tensor = max(info.nbytes for info in index.tensors.values())
    largest_leaf = max(a.nbytes for a in leaves.values())
    out = Path(tempfile.mkdtemp(dir=src.parent)) / "export"
    try:
        baseline = harness.current_rss()
        start = time.perf_counter()
        with harness.RssSampler() as sampler:
            export_hf(model, out, reference=src, max_shard_size="500MB")
        seconds = time.perf_counter() - start
        exported = sum(p.stat().st_size for p in out.glob("*.safetensors"))
        exact = _bit_exact(src, out)
    finally:
        shutil.rmtree(out.parent)
    return {
        "checkpoint": str(src),
        "scan_layers": scan_layers,
        "checkpoint_mib": round(index.total_bytes / MIB, 1),
        "export_seconds": round(seconds, 2),
        "export_gb_per_s": round(exported / seconds / 1e9, 2),
        "baseline_rss_mib": round(baseline / MIB, 1),
        "peak_rss_mib": round(sampler.peak / MIB, 1),
        "transient_mib": round((sampler.peak - baseline) / MIB, 1),
        "largest_hf_tensor_mib": round(largest_tensor / MIB, 1),
        "largest_leaf_mib": round(largest_leaf / MIB, 1),
        "bit_exact": exact,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--unscanned", action="store_true", help="load with scan_layers=False")
    args = parser.parse_args(argv)
    print(json.dumps(run(args.size_gib, not args.unscanned), indent=1))


if __name__ == "__main__":
    main()
