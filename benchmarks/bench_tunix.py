"""tunix's own Qwen3 loader against otfload, on a Qwen3-shaped bf16 checkpoint (google-tunix 0.1.7).

    PYTHONPATH=/work/main /tmp/tunix-venv/bin/python -m benchmarks.bench_tunix --size-gib 1.0 --repeat 3

tunix needs safetensors < 0.8, so this runs in tunix's own venv (docs/byo_model.md#tunix), with
otfload from the working tree on ``PYTHONPATH``. The checkpoint is written once into ``--work``
(default ``/tmp/otfload-bench-tunix``): HF key names (``q_norm`` / ``k_norm`` included), untied
``lm_head``, random bf16 values, shards of at most ``--shard-mb``. Every method loads it onto the
same 2×4 ``('fsdp', 'tp')`` mesh of 8 simulated CPU devices (Auto axes, as tunix needs), in a fresh
process, warm page cache, interleaved rounds, medians:

* ``tunix`` — ``tunix.models.qwen3.params.create_model_from_safe_tensors(dir, config, mesh=mesh)``
  (``dtype=None``: the checkpoint's bf16 kept; ``mode="auto"``, the optimized mmap loader here);
* ``otfload_tunix`` — ``nnx.eval_shape`` of tunix's ``Qwen3`` (``param_dtype=bfloat16``, so nothing
  is cast) and ``otfload.load_params`` with ``otfload.mappings.tunix_qwen3.TABLE``: the same tree,
  values and shardings as ``tunix``;
* ``otfload_tunix_factory`` — the same, handing ``load_params`` the function that builds the module
  (``lambda: Qwen3(config, rngs=nnx.Rngs(0))``): otfload makes it abstract with
  ``otfload.abstract_module`` (``nnx.eval_shape`` without JAX ≤ 0.10's quadratic tracing cost);
* ``otfload_own`` — ``otfload.from_pretrained(dir, mesh=mesh)``: otfload's own Qwen3 module
  (scanned layers, HF's ``[out, in]`` orientation, its default sharding rules).

Timed, for every method alike: from the ``ModelConfig`` (parsed before) to a loaded ``nnx.Module``
whose arrays are ready — building the abstract module, reading, transposing, placing (for the
tunix-tree methods the abstract module alone — ``nnx.eval_shape`` of tunix's ``Qwen3``, or
``otfload.abstract_module`` for ``otfload_tunix_factory`` — is timed again after the load, in the
same process, and reported apart: it is a large share of each). Imports, the
mesh, the page-cache warming and one warm-up load of a tiny checkpoint with the same method happen
before the clock starts. After the clock, in the first round (``--check all``: every round), each
process hashes every parameter back in HF's orientation (``model.layers.{i}.mlp.down_proj.weight``
...) and the parent compares the hashes with those of the checkpoint's own bytes: equal means
bitwise equal to the checkpoint, hence to each other. ``tunix`` and the ``otfload_tunix`` methods
must also agree on every leaf's dtype and ``PartitionSpec``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from benchmarks import harness
from benchmarks.make_checkpoint import Dims, ensure_written, random_bf16

METHODS = ("tunix", "otfload_tunix", "otfload_tunix_factory", "otfload_own")
GIB = harness.GIB
DEFAULT_WORK = Path("/tmp/otfload-bench-tunix")
MESH_AXES = ("fsdp", "tp")
TP = 4


# --- the checkpoint --------------------------------------------------------------------------------


def qwen3_config(dims: Dims) -> dict:
    """The ``config.json`` of a transformers ``Qwen3ForCausalLM`` of this shape."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": dims.vocab,
        "hidden_size": dims.hidden,
        "intermediate_size": dims.intermediate,
        "num_hidden_layers": dims.layers,
        "num_attention_heads": dims.heads,
        "num_key_value_heads": dims.kv_heads,
        "head_dim": dims.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "initializer_range": 0.02,
        "rms_norm_eps": 1e-6,
        "use_cache": True,
        # tunix 0.1.7's Qwen3 rotates with 1e6 whatever ModelConfig says: Qwen3's own value
        "rope_theta": 1_000_000.0,
        "rope_scaling": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": dims.layers,
        "tie_word_embeddings": False,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "torch_dtype": "bfloat16",
    }


# A dense Qwen3 (HF key names, q_norm / k_norm included; heads * head_dim need not be hidden), with
# widths between Qwen3-0.6B's and -1.7B's; the layer count sets the size. A smaller vocabulary than
# Qwen3's 151,936 keeps most bytes in the layers at 1 GiB.
QWEN3 = dict(heads=16, kv_heads=8, head_dim=128, vocab=32768, qk_norm=True)
WIDE = dict(hidden=1536, intermediate=4608)
TINY = Dims(hidden=64, intermediate=128, layers=2, heads=8, kv_heads=4, head_dim=16, vocab=256, qk_norm=True)


def shape_for(size_bytes: int) -> Dims:
    """The :data:`WIDE` Qwen3 shape whose size is closest to ``size_bytes`` (two layers at least)."""
    base = Dims(**WIDE, layers=0, **QWEN3).nbytes
    per_layer = Dims(**WIDE, layers=1, **QWEN3).nbytes - base
    return Dims(**WIDE, layers=max(2, round((size_bytes - base) / per_layer)), **QWEN3)


def _values(name: str, shape: tuple[int, ...], rng):
    """Random bf16 values; norms near 1 (random too, so a misplaced norm shows in the check)."""
    import ml_dtypes
    import numpy as np

    x = random_bf16(shape, rng)
    if name.endswith("norm.weight"):
        x = (x.astype(np.float32) + 1.0).astype(ml_dtypes.bfloat16)
    return x


def ensure_checkpoint(directory: Path, dims: Dims, shard_bytes: int) -> Path:
    """The Qwen3 checkpoint of ``dims`` in ``directory``, written first unless it is there."""
    return ensure_written(directory, dims, config=qwen3_config(dims), values=_values, shard_bytes=shard_bytes)


def file_hashes(directory: Path) -> dict[str, str]:
    """Every tensor's hash, from the bytes in the safetensors files."""
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        header, data_start = harness.safetensors_header(path)
        with open(path, "rb") as f:
            for name, meta in header.items():
                begin, end = meta["data_offsets"]
                f.seek(data_start + begin)
                out[name] = _digest(f.read(end - begin))
    return out


def _digest(data) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


# --- the loaded trees, back in HF's orientation ----------------------------------------------------


def _params(model) -> dict:
    """``{dotted path: jax.Array}`` of an NNX module's parameters."""
    from flax import nnx

    return {".".join(map(str, k)): v.get_value() for k, v in nnx.state(model, nnx.Param).flat_state()}


def _hf_tunix(path: str, x):
    """(HF name, ``[out, in]`` array) of each of tunix's Qwen3 leaves (unscanned, ``[in, out]``)."""
    if path == "embedder.input_embedding":
        return [("model.embed_tokens.weight", x)]
    if path == "final_norm.w":
        return [("model.norm.weight", x)]
    if path == "lm_head.w":
        return [("lm_head.weight", x.T)]
    _, i, rest = path.split(".", 2)
    p = f"model.layers.{i}"
    if rest.endswith("_proj.w"):  # attention: q/k/v [embed, heads, head_dim], o [heads, head_dim, embed]
        name = f"{p}.self_attn.{rest.split('.')[1]}.weight"
        flat = x.reshape(x.shape[0] * x.shape[1], -1) if rest.startswith("attn.o_") else x.reshape(x.shape[0], -1)
        return [(name, flat.T)]
    if rest.endswith(".kernel"):  # mlp.*_proj.kernel [in, out]
        return [(f"{p}.{rest.removesuffix('.kernel')}.weight", x.T)]
    norms = {"input_layernorm.w": "input_layernorm", "post_attention_layernorm.w": "post_attention_layernorm",
             "attn.q_norm.w": "self_attn.q_norm", "attn.k_norm.w": "self_attn.k_norm"}
    return [(f"{p}.{norms[rest]}.weight", x)]


_OWN_LAYER = {  # otfload's Llama-family module, scanned: leaf → HF name within the layer
    "input_norm.scale": "input_layernorm", "post_attn_norm.scale": "post_attention_layernorm",
    "attn.q.kernel": "self_attn.q_proj", "attn.k.kernel": "self_attn.k_proj", "attn.v.kernel": "self_attn.v_proj",
    "attn.o.kernel": "self_attn.o_proj", "attn.q_norm.scale": "self_attn.q_norm",
    "attn.k_norm.scale": "self_attn.k_norm", "mlp.gate.kernel": "mlp.gate_proj", "mlp.up.kernel": "mlp.up_proj",
    "mlp.down.kernel": "mlp.down_proj",
}


def _hf_own(path: str, x):
    """(HF name, ``[out, in]`` array) of otfload's own Qwen3 leaves (scanned ``layers``, ``[out, in]``:
    each layer's slice, flattened to two dims, is the HF tensor)."""
    top = {"embed.embedding": "model.embed_tokens.weight", "final_norm.scale": "model.norm.weight",
           "lm_head.kernel": "lm_head.weight"}
    if path in top:
        return [(top[path], x)]
    name = _OWN_LAYER[path.removeprefix("layers.")]
    return [(f"model.layers.{i}.{name}.weight", x[i].reshape(x.shape[1], -1) if x.ndim > 2 else x[i])
            for i in range(x.shape[0])]


def loaded_hashes(method: str, model) -> tuple[dict[str, str], dict[str, str]]:
    """``({HF name: hash}, {leaf: 'dtype spec'})`` of a loaded module, one leaf gathered at a time."""
    import numpy as np

    to_hf = _hf_own if method == "otfload_own" else _hf_tunix
    hashes, layout = {}, {}
    for path, leaf in _params(model).items():
        layout[path] = f"{leaf.dtype} {leaf.sharding.spec}"
        host = np.asarray(leaf)
        for name, x in to_hf(path, host):
            hashes[name] = _digest(np.ascontiguousarray(x).view(np.uint8).data)
        del host
    return hashes, layout


# --- child: one method, one load -------------------------------------------------------------------


def tunix_config(hf: dict):
    """tunix's ``ModelConfig`` for a ``config.json``, parameters bf16 (the checkpoint's dtype)."""
    import jax.numpy as jnp
    from tunix.models.qwen3 import model as qwen3_model

    return qwen3_model.ModelConfig(
        num_layers=hf["num_hidden_layers"], vocab_size=hf["vocab_size"], embed_dim=hf["hidden_size"],
        hidden_dim=hf["intermediate_size"], num_heads=hf["num_attention_heads"], head_dim=hf["head_dim"],
        num_kv_heads=hf["num_key_value_heads"], rope_theta=int(hf["rope_theta"]), norm_eps=hf["rms_norm_eps"],
        use_tied_embedding=hf["tie_word_embeddings"], dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
    )


def child(method: str, directory: Path, warmup: Path, devices: int, check: bool) -> dict:
    """Load ``directory`` once with ``method`` and measure it (in a fresh process)."""
    import jax
    from flax import nnx

    # every method imports tunix's Qwen3 and otfload alike, whichever it uses
    from tunix.models.qwen3 import model as qwen3_model
    from tunix.models.qwen3 import params as qwen3_params

    import otfload
    from benchmarks.target import check_devices
    from otfload.mappings import tunix_qwen3

    check_devices(devices)
    mesh = jax.make_mesh((devices // TP, TP), MESH_AXES, axis_types=(jax.sharding.AxisType.Auto,) * 2)

    def loader(path: Path):
        config = tunix_config(json.loads((path / "config.json").read_text()))
        if method == "tunix":
            return lambda: qwen3_params.create_model_from_safe_tensors(str(path), config, mesh=mesh, dtype=None,
                                                                        mode="auto")
        if method == "otfload_tunix":
            def run():
                abstract = nnx.eval_shape(lambda: qwen3_model.Qwen3(config, rngs=nnx.Rngs(0)))
                return otfload.load_params(path, abstract, tunix_qwen3.TABLE, mesh=mesh, progress=False)
            return run
        if method == "otfload_tunix_factory":
            return lambda: otfload.load_params(path, lambda: qwen3_model.Qwen3(config, rngs=nnx.Rngs(0)),
                                               tunix_qwen3.TABLE, mesh=mesh, progress=False)
        return lambda: otfload.from_pretrained(path, mesh=mesh, progress=False)

    def ready(model) -> None:
        jax.block_until_ready(jax.tree.leaves(nnx.state(model)))

    ready(loader(warmup)())  # warm-up: the same code paths on a tiny checkpoint
    run = loader(directory)
    harness.warm(directory)
    with harness.measured() as measured:
        model = run()
        ready(model)
    result = {"method": method, **measured, "placed_bytes": sum(x.nbytes for x in _params(model).values())}
    if method != "otfload_own":  # the share of the timed part tunix's abstract module takes, measured apart
        config = tunix_config(json.loads((directory / "config.json").read_text()))
        abstract = otfload.abstract_module if method == "otfload_tunix_factory" else nnx.eval_shape
        start = time.perf_counter()
        abstract(lambda: qwen3_model.Qwen3(config, rngs=nnx.Rngs(0)))
        result["eval_shape_seconds"] = time.perf_counter() - start
    if check:
        result["hashes"], result["layout"] = loaded_hashes(method, model)
    return result


# --- parent ----------------------------------------------------------------------------------------


def run_child(method: str, directory: Path, warmup: Path, devices: int, check: bool) -> dict:
    args = ["--child", method, "--dir", str(directory), "--warmup-dir", str(warmup), "--devices", str(devices),
            *(["--hash"] if check else [])]  # fmt: skip
    return harness.run_child("benchmarks.bench_tunix", args, devices=devices, what=method)


def measure(methods: list[str], directory: Path, warmup: Path, devices: int, repeat: int,
            check_all: bool) -> tuple[dict[str, dict], list[str]]:
    """Median figures per method over interleaved rounds, and the bitwise check's findings."""
    reference = file_hashes(directory)
    problems: list[str] = []
    layouts: dict[str, dict[str, str]] = {}
    rounds_run = dict.fromkeys(methods, 0)

    def run(method: str) -> dict:
        rounds_run[method] += 1
        result = run_child(method, directory, warmup, devices, check=check_all or rounds_run[method] == 1)
        if "hashes" in result:
            hashes = result.pop("hashes")
            layouts[method] = result.pop("layout")
            wrong = sorted(k for k in reference if hashes.get(k) != reference[k])
            extra = sorted(set(hashes) - set(reference))
            if wrong or extra:
                problems.append(f"round {rounds_run[method]} {method}: {len(wrong)} tensors differ from the "
                                f"checkpoint {wrong[:3]}, {len(extra)} unknown {extra[:3]}")  # fmt: skip
            result["checked"] = len(reference) - len(wrong)
        return result

    runs = harness.rounds(methods, repeat, run)
    tunix_layout = layouts.get("tunix")
    for method in (m for m in layouts if m.startswith("otfload_tunix") and tunix_layout is not None):
        differ = sorted(k for k in tunix_layout if tunix_layout[k] != layouts[method].get(k))
        if differ or layouts[method].keys() != tunix_layout.keys():
            problems.append(f"tunix and {method} differ in dtype/PartitionSpec of {len(differ)} leaves {differ[:3]}")
    out = {}
    for method, rs in runs.items():
        out[method] = {
            **harness.summarize(rs, ("peak_over_before",)),
            "eval_shape_seconds": statistics.median(r["eval_shape_seconds"] for r in rs)
            if "eval_shape_seconds" in rs[0] else None,
            "checked": next((r["checked"] for r in rs if "checked" in r), 0),
        }
    return out, problems


def table(results: dict[str, dict]) -> str:
    base = results.get("tunix")
    columns = ["method", "wall s (median)", "wall runs (s)", "CPU s (median)", "CPU runs (s)",
               "peak RSS − before GiB", "speed / tunix (wall, CPU)", "of which abstract module s (apart)"]  # fmt: skip
    rows = [[method, f"{r['seconds']:.2f}", harness.runs_cell(r["all_seconds"]), f"{r['cpu_seconds']:.2f}",
             harness.runs_cell(r["all_cpu_seconds"]), f"{r['peak_over_before'] / GIB:.2f}", harness.speed_cell(base, r),
             _opt(r["eval_shape_seconds"])] for method, r in results.items()]  # fmt: skip
    return harness.table(columns, rows)


# Issue 46: into tunix's module, by the documented route and by otfload's own model, against tunix's loader.
TARGETS = {"otfload_tunix": 1.2, "otfload_tunix_factory": None, "otfload_own": 1.2}


def targets_table(results: dict[str, dict]) -> str:
    """Each otfload method's speed over tunix's loader (wall and CPU time) and its verdict."""
    base = results.get("tunix")
    if base is None:
        return "(tunix not measured: no ratios)"
    rows = []
    for method, target in TARGETS.items():
        if method in results:
            r = results[method]
            wall, cpu = base["seconds"] / r["seconds"], base["cpu_seconds"] / r["cpu_seconds"]
            judged = ["", ""] if target is None else [f"≥ {target:g}", "PASS" if wall >= target else "MISS"]
            rows.append([f"{method} speed / tunix", f"{wall:.2f}", f"{cpu:.2f}", *judged])
    return harness.table(["figure", "measured (wall)", "measured (CPU time)", "target", "verdict (wall)"], rows)


def _opt(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds:.2f}"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--work", type=Path, default=DEFAULT_WORK, help="where the checkpoints are written")
    parser.add_argument("--shard-mb", type=int, default=500, help="largest shard, MB (HF's limit is 2000 here)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--devices", type=int, default=8)
    parser.add_argument("--check", choices=("first", "all"), default="first",
                        help="which rounds hash every loaded parameter against the checkpoint")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--warmup-dir", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--hash", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        harness.report(child(args.child, args.dir, args.warmup_dir, args.devices, args.hash))
        return
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {', '.join(METHODS)}")
    if args.shard_mb * 10**6 > 2 * 10**9:
        parser.error("--shard-mb: at most 2000")
    load_start = harness.load_line()
    shape = shape_for(int(args.size_gib * GIB))
    directory = ensure_checkpoint(args.work / f"qwen3-{args.size_gib:g}g", shape, args.shard_mb * 10**6)
    warmup = ensure_checkpoint(args.work / "qwen3-tiny", TINY, args.shard_mb * 10**6)
    files = sorted(directory.glob("*.safetensors"))
    print(f"checkpoint {directory}: {asdict(shape)}, {shape.nbytes / GIB:.3f} GiB in {len(files)} files; "
          f"{args.devices} devices, mesh fsdp={args.devices // TP} x tp={TP}; at the start: {load_start}", flush=True)
    results, problems = measure(methods, directory, warmup, args.devices, args.repeat, args.check == "all")
    print(f"\nTimed: ModelConfig → loaded nnx.Module with every array ready (abstract module, read, transpose, "
          f"place); fresh process per run, warm page cache, warm-up load of a tiny checkpoint first, "
          f"median of {args.repeat}.\n")
    print(table(results) + "\n\n" + targets_table(results) + "\n")
    if "tunix" in results:
        base = results["tunix"]
        for method, r in results.items():
            if method != "tunix":
                print(f"{method} / tunix: wall {base['seconds'] / r['seconds']:.2f}× as fast, CPU "
                      f"{base['cpu_seconds'] / r['cpu_seconds']:.2f}× as little, peak RSS − before "
                      f"{r['peak_over_before'] / GIB:.2f} vs {base['peak_over_before'] / GIB:.2f} GiB")
    shapes = {m: r["eval_shape_seconds"] for m, r in results.items() if r["eval_shape_seconds"] is not None}
    if shapes:
        print("wall minus the median abstract module of tunix's Qwen3 (measured apart, after the load, same "
              "process; approximate): "
              + ", ".join(f"{m} {results[m]['seconds'] - s:.2f} s" for m, s in shapes.items()))
    n = len(file_hashes(directory))
    if problems:
        print("bitwise check FAILED:\n  " + "\n  ".join(problems))
    else:
        checked = ", ".join(f"{m} {r['checked']}/{n}" for m, r in results.items())
        print(f"bitwise check passed: every tensor of every checked load equals the checkpoint's bytes ({checked}); "
              "tunix and the otfload_tunix methods agree on every leaf's dtype and PartitionSpec"
              if "tunix" in results and any(m.startswith("otfload_tunix") for m in results) else
              f"bitwise check passed: every tensor of every checked load equals the checkpoint's bytes ({checked})")
    print(f"at the start: {load_start}; at the end: {harness.load_line()}")


if __name__ == "__main__":
    main()
