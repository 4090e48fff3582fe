"""The load target the benchmarks share: the mesh, and one checkpoint planned onto it with otfload's own
route to load it (measuring a run is :mod:`benchmarks.harness`'s).

The target is planned once per process with otfload's planner, so every method loads the same
tensors onto the same ``NamedSharding`` s. A Mixtral checkpoint goes through
``otfload.from_pretrained`` when a family supports it, else through ``otfload.load_params`` with the
small benchmark mapping below (experts × layers stacked from per-expert keys).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh

import otfload
from otfload.errors import OtfloadError
from otfload.index.checkpoint import open_index
from otfload.opening import storage_dtype
from otfload.plan.abstract import abstract_from_pytree
from otfload.plan.hooks import Reshape, Transpose
from otfload.plan.mapping import MappingTable, Rule
from otfload.plan.planner import LoadPlan, build_plan
from otfload.sources import open_source

TP = 4


def check_devices(devices: int, platform: str = "cpu") -> None:
    """Stop unless JAX has ``devices`` simulated CPU devices (``platform="cpu"``), or at least
    ``devices`` devices of another ``platform``."""
    have = jax.devices()
    if platform == "cpu" and len(have) != devices:
        raise SystemExit(f"expected {devices} devices, JAX has {len(have)}: is XLA_FLAGS set?")
    if platform != "cpu" and (have[0].platform != platform or len(have) < devices):
        raise SystemExit(f"expected {devices} {platform} devices, JAX has {have}")


def bench_mesh(n_devices: int | None = None) -> Mesh:
    """``tp = min(4, n)``, the rest on ``fsdp``: the 2×4 mesh on 8 devices."""
    n = len(jax.devices()) if n_devices is None else n_devices
    tp = min(TP, n)
    return otfload.make_mesh({"fsdp": n // tp, "tp": tp}, jax.devices()[:n])


@dataclass
class Target:
    """One checkpoint planned onto one mesh; ``load_otfload`` is otfload's own end-to-end route."""

    directory: Path
    mesh: Mesh
    plan: LoadPlan
    checkpoint_bytes: int
    route: str
    load_otfload: Callable[..., tuple[Any, otfload.LoadReport]]  # keyword options of the load call


def _sds(shape: tuple[int, ...], axes: tuple[str | None, ...], mesh: Mesh, dtype: np.dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype, sharding=otfload.logical_to_sharding(axes, shape, mesh))


def mixtral_abstract(cfg: dict, mesh: Mesh, dtype: np.dtype) -> dict:
    """A Mixtral parameter tree (scanned layers, experts × layers stacked) with DEFAULT_RULES shardings."""
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    n, e, hd = cfg["num_hidden_layers"], cfg["num_local_experts"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]

    def p(shape, axes):
        return _sds(shape, axes, mesh, dtype)

    return {
        "embed": p((v, h), ("vocab", "embed")),
        "final_norm": p((h,), ("norm",)),
        "lm_head": p((h, v), ("embed", "vocab")),
        "layers": {
            "input_norm": p((n, h), ("layers", "norm")),
            "post_attn_norm": p((n, h), ("layers", "norm")),
            "attn": {
                "q": p((n, h, heads, hd), ("layers", "embed", "heads", "head_dim")),
                "k": p((n, h, kv, hd), ("layers", "embed", "kv_heads", "head_dim")),
                "v": p((n, h, kv, hd), ("layers", "embed", "kv_heads", "head_dim")),
                "o": p((n, heads, hd, h), ("layers", "heads", "head_dim", "embed")),
            },
            "router": p((n, h, e), ("layers", "embed", None)),
            "experts": {
                "w1": p((n, e, h, i), ("layers", "experts", "embed", "mlp")),
                "w3": p((n, e, h, i), ("layers", "experts", "embed", "mlp")),
                "w2": p((n, e, i, h), ("layers", "experts", "mlp", "embed")),
            },
        },
    }


def mixtral_mapping(cfg: dict) -> MappingTable:
    """Hub Mixtral keys → :func:`mixtral_abstract` leaves; ``{layer}`` and ``{expert}`` become stack axes."""
    h, hd = cfg["hidden_size"], cfg["head_dim"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    layer, moe = "model.layers.{layer}", "model.layers.{layer}.block_sparse_moe"
    t = Transpose()
    return MappingTable(
        (
            Rule("embed", "model.embed_tokens.weight"),
            Rule("final_norm", "model.norm.weight"),
            Rule("lm_head", "lm_head.weight", (t,)),
            Rule("layers.input_norm", f"{layer}.input_layernorm.weight"),
            Rule("layers.post_attn_norm", f"{layer}.post_attention_layernorm.weight"),
            Rule("layers.attn.q", f"{layer}.self_attn.q_proj.weight", (t, Reshape((h, heads, hd)))),
            Rule("layers.attn.k", f"{layer}.self_attn.k_proj.weight", (t, Reshape((h, kv, hd)))),
            Rule("layers.attn.v", f"{layer}.self_attn.v_proj.weight", (t, Reshape((h, kv, hd)))),
            Rule("layers.attn.o", f"{layer}.self_attn.o_proj.weight", (t, Reshape((heads, hd, h)))),
            Rule("layers.router", f"{moe}.gate.weight", (t,)),
            *(Rule(f"layers.experts.{w}", f"{moe}.experts.{{expert}}.{w}.weight", (t,)) for w in ("w1", "w2", "w3")),
        )
    )


def _via_load_params(directory: Path, mesh: Mesh, why: str) -> Target:
    index = open_index(open_source(directory))
    abstract = mixtral_abstract(index.config, mesh, storage_dtype(index))
    table = mixtral_mapping(index.config)
    leaves, _ = abstract_from_pytree(abstract, mesh)
    plan = build_plan(index, leaves, table, index.config, strict=True)

    def load(**options: Any):
        return otfload.load_params(directory, abstract, table, mesh=mesh, progress=False, return_report=True, **options)

    return Target(directory, mesh, plan, index.total_bytes, f"load_params with the benchmark mapping ({why})", load)


def open_target(directory: Path, mesh: Mesh) -> Target:
    """Plan ``directory`` onto ``mesh`` the way otfload would load it."""
    index = open_index(open_source(directory))
    try:
        _, plan, _ = otfload.plan_model(directory, mesh=mesh)
    except OtfloadError as e:
        if index.config.get("model_type") != "mixtral":
            raise
        return _via_load_params(directory, mesh, f"from_pretrained: {type(e).__name__}")

    def load(**options: Any):
        return otfload.from_pretrained(directory, mesh=mesh, progress=False, return_report=True, **options)

    return Target(directory, mesh, plan, index.total_bytes, "from_pretrained", load)


def resident_fraction(directory: Path) -> float | None:
    """The fraction of the checkpoint's safetensors pages in the page cache (``mincore``)."""
    from otfload.sources.residency import file_resident_fraction

    files = sorted(directory.glob("*.safetensors"))
    sizes = [f.stat().st_size for f in files]
    fractions = [file_resident_fraction(f) for f in files]
    if not files or any(x is None for x in fractions):
        return None
    return sum(x * n for x, n in zip(fractions, sizes, strict=True)) / max(1, sum(sizes))
