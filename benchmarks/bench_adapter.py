"""Adapter benchmark: otfload loading a base with a PEFT LoRA adapter merged on the fly vs the base alone.

    python -m benchmarks.bench_adapter --size-gib 0.25 [--rank 16] [--repeat 3] [--devices 8]
        [--dir bench_data/llama-0.25g] [--cold] [--json out.json]

One bf16 Llama-shaped checkpoint (``benchmarks.make_checkpoint``; ``--dir`` reuses one) and, next to
it (``<dir>-lora<rank>``), a PEFT-format adapter with a rank-``--rank`` bf16 LoRA on every projection
of every layer (``q/k/v/o_proj``, ``gate/up/down_proj``), written with numpy (random factors, the
keys and ``adapter_config.json`` PEFT writes). Methods, each run in a fresh process on ``--devices``
simulated CPU devices (the 2×4 mesh of bench_load), interleaved over ``--repeat`` rounds, median
reported:

- ``base``: ``otfload.from_pretrained(dir, mesh=...)``;
- ``adapter``: ``otfload.from_pretrained(dir, adapter=<dir>-lora<rank>, mesh=...)`` — each device box
  of each adapted leaf is the base box plus ``s·B[rows] @ A[:, cols]`` computed in float32, then cast.

Each run records wall and CPU seconds, the bytes otfload read (``LoadReport.bytes_read``: base and
adapter bytes) and placed, and the peak RSS (``ru_maxrss`` or a 10 ms sampler, the larger), with the
RSS before the load. Unless ``--cold``, every run first reads its files once, untimed (as bench_load).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import harness

METHODS = ("base", "adapter")
GIB = harness.GIB
DEFAULT_RANK = 16
LORA_ALPHA = 32  # s = alpha / r = 2 at rank 16: a typical published setting
# Magnitude of the random factors: deltas of the size of the base's own values (2^-10 .. 2^-3).
FACTOR_STD = 0.02
PROJECTIONS = {  # module -> (out, in) as functions of the config
    "self_attn.q_proj": lambda c: (c["num_attention_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.k_proj": lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.v_proj": lambda c: (c["num_key_value_heads"] * c["head_dim"], c["hidden_size"]),
    "self_attn.o_proj": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
    "mlp.gate_proj": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "mlp.up_proj": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "mlp.down_proj": lambda c: (c["hidden_size"], c["intermediate_size"]),
}


def write_lora(base: Path, out: Path, rank: int, seed: int = 0) -> Path:
    """A PEFT-format adapter on every projection of ``base`` (bf16 factors), unless already there."""
    import ml_dtypes
    import numpy as np
    from safetensors.numpy import save_file

    config = json.loads((base / "config.json").read_text())
    config.setdefault("head_dim", config["hidden_size"] // config["num_attention_heads"])
    adapter_config = {
        "peft_type": "LORA", "r": rank, "lora_alpha": LORA_ALPHA, "target_modules": sorted(
            m.rsplit(".", 1)[1] for m in PROJECTIONS), "bias": "none", "use_dora": False, "fan_in_fan_out": False,
        "base_model_name_or_path": str(base), "task_type": "CAUSAL_LM",
    }
    marker = out / "adapter_config.json"
    if marker.exists() and json.loads(marker.read_text()) == adapter_config:
        return out
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, dims in PROJECTIONS.items():
            rows, cols = dims(config)
            key = f"base_model.model.model.layers.{layer}.{module}"
            for name, shape in ((f"{key}.lora_A.weight", (rank, cols)), (f"{key}.lora_B.weight", (rows, rank))):
                tensors[name] = (rng.standard_normal(shape, np.float32) * FACTOR_STD).astype(ml_dtypes.bfloat16)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    marker.write_text(json.dumps(adapter_config, indent=1))
    return out


def adapter_dir(base: Path, rank: int) -> Path:
    return base.parent / f"{base.name}-lora{rank}"


# --- child: one method, one load, in this process ---------------------------------------------------


def child(method: str, directory: Path, adapter: Path, devices: int, cold: bool) -> dict:
    """Run ``method`` once and measure it (in a fresh process)."""
    import jax

    import otfload
    from benchmarks.target import bench_mesh, check_devices

    check_devices(devices)
    mesh = bench_mesh(devices)
    options = {"adapter": adapter} if method == "adapter" else {}
    if not cold:
        harness.warm(directory)
        if method == "adapter":
            harness.warm(adapter)
    with harness.measured() as measured:
        model, report = otfload.from_pretrained(directory, mesh=mesh, progress=False, return_report=True, **options)
        jax.block_until_ready(jax.tree.leaves(model))
    return {"method": method, **measured, "bytes_read": report.bytes_read, "bytes_placed": report.bytes_placed,
            "requests": report.requests}  # fmt: skip


# --- parent: orchestration --------------------------------------------------------------------------


def run_child(method: str, directory: Path, adapter: Path, devices: int, cold: bool) -> dict:
    if cold:
        harness.drop_caches(directory)
        harness.drop_caches(adapter)
    args = ["--child", method, "--dir", str(directory), "--adapter-dir", str(adapter), "--devices", str(devices),
            *(["--cold"] if cold else [])]  # fmt: skip
    return harness.run_child("benchmarks.bench_adapter", args, devices=devices, what=method)


def measure(directory: Path, adapter: Path, devices: int, repeat: int, cold: bool) -> dict[str, dict]:
    """Median figures of each method over ``repeat`` interleaved rounds of fresh processes."""
    runs = harness.rounds(METHODS, repeat, lambda m: run_child(m, directory, adapter, devices, cold))
    keys = ("peak_rss", "rss_before", "peak_over_before", "bytes_read", "bytes_placed")
    return {m: harness.summarize(rs, keys) for m, rs in runs.items()}


def results_table(results: dict[str, dict]) -> str:
    columns = ["load", "seconds (median)", "runs (s)", "CPU s", "bytes read GiB", "placed GiB", "peak RSS GiB",
               "peak − before GiB"]  # fmt: skip
    rows = [[method, f"{r['seconds']:.2f}", harness.runs_cell(r["all_seconds"]), f"{r['cpu_seconds']:.2f}",
             f"{r['bytes_read'] / GIB:.3f}", f"{r['bytes_placed'] / GIB:.3f}", f"{r['peak_rss'] / GIB:.2f}",
             f"{r['peak_over_before'] / GIB:.2f}"] for method, r in results.items()]  # fmt: skip
    lines = [harness.table(columns, rows)]
    base, adapted = results["base"], results["adapter"]
    lines.append("")
    lines.append(f"adapter / base: time {adapted['seconds'] / base['seconds']:.2f}x, CPU "
                f"{adapted['cpu_seconds'] / base['cpu_seconds']:.2f}x, bytes read "
                f"{adapted['bytes_read'] / base['bytes_read']:.3f}x, peak RSS "
                f"{adapted['peak_rss'] / base['peak_rss']:.2f}x")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=0.25)
    parser.add_argument("--dir", type=Path, default=None,
                        help="the bf16 checkpoint, written first if missing (default: bench_data/llama-<size>g)")
    parser.add_argument("--rank", type=int, default=DEFAULT_RANK)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--cold", action="store_true", help="drop the page cache before every run (root)")
    parser.add_argument("--json", type=Path, default=None, help="also write every figure here")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--adapter-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.child:
        harness.report(child(args.child, args.dir, args.adapter_dir, args.devices, args.cold))
        return
    from benchmarks.make_checkpoint import ensure_checkpoint

    print(harness.machine_line())
    base = ensure_checkpoint(args.size_gib, out=args.dir)
    adapter = write_lora(base, adapter_dir(base, args.rank), args.rank)
    base_bytes = harness.tensor_bytes(base)
    adapter_bytes = (adapter / "adapter_model.safetensors").stat().st_size
    print(f"base {base}: {base_bytes / GIB:.3f} GiB; adapter {adapter}: rank {args.rank} on every projection, "
          f"{adapter_bytes / 2**20:.1f} MiB")
    mode = "cold (page cache dropped before each run)" if args.cold else "warm page cache"
    print(f"{args.devices} devices, {mode}, median of {args.repeat} interleaved fresh-process runs\n")
    results = measure(base, adapter, args.devices, args.repeat, args.cold)
    print(results_table(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
