"""The bundled models at real sizes: sparse vs dense MoE, attention memory, KV-cache decoding.

    python -m benchmarks.bench_models                      # all three sections
    python -m benchmarks.bench_models --sections moe --repeat 5
    python -m benchmarks.bench_models --smoke              # tiny shapes, seconds (the smoke test)

Random weights, float32, one CPU device (run it without XLA_FLAGS' simulated devices). Every figure
comes from one process: compile once, then the median of ``--repeat`` timed calls.

* ``moe`` — one MoE feed-forward (router, top-k, experts; Mixtral-style SwiGLU) on ``T`` tokens with
  many experts, for each implementation of :mod:`otfload.models.experts`: ``dense`` (every expert
  on every token, the former model code), ``blocks`` (the CPU default) and ``ragged``
  (``jax.lax.ragged_dot``, which XLA:CPU lowers to a masked dot against every expert; run at the
  smallest token count only). FLOPs from
  XLA's cost analysis (``jitted.lower(...).compile().cost_analysis()``); XLA counts a loop body
  once, so for ``blocks`` the executed FLOPs are the program's count plus one block step's count
  (compiled alone) times the blocks the routing actually occupies beyond the first. Memory is XLA's
  temporary buffer size for the program (``memory_analysis().temp_size_in_bytes``: the activations'
  peak; weights and inputs are arguments). Then a whole MoE model forward (2 layers, scanned).
* ``attention`` — one attention call ``[1, s, heads, dim]`` from 512 to 8192 tokens: ``chunked``
  (the CPU default), ``eager`` (the former code: KV heads repeated, full ``[b, h, s, s]`` f32
  logits) and ``dpa`` (``jax.nn.dot_product_attention``, XLA implementation on CPU). Quadratic
  methods whose temp memory would pass ``--max-temp-gib`` are compiled (memory) but not run.
* ``decode`` — a Llama-shaped model: time per new token with the KV cache (one jitted step)
  against recomputing the whole context (the model without a cache), as the context grows.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from benchmarks import harness
from otfload.families.llama.config import LlamaConfig
from otfload.families.llama.model import LlamaForCausalLM
from otfload.families.mixtral.config import mixtral_config
from otfload.families.mixtral.model import MoeForCausalLM
from otfload.models.attention import CHUNKED, DPA, Context, attention
from otfload.models.experts import BLOCKS, DENSE, RAGGED, block_size, expert_ffn
from otfload.models.moe import route

MIB = 2**20
GIB = 2**30
# MoE shapes: many small experts, as in DeepSeek/Qwen3-MoE (64 experts, top 4).
MOE = dict(hidden=1024, inter=512, experts=64, top_k=4, tokens=(512, 2048))
MOE_MODEL = dict(hidden_size=512, intermediate_size=256, num_local_experts=64, num_experts_per_tok=4,
                 num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2, vocab_size=4096, tokens=2048)
ATTENTION = dict(heads=8, kv_heads=2, dim=64, seqs=(512, 1024, 2048, 4096, 8192))
DECODE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
              num_key_value_heads=2, vocab_size=4096, contexts=(256, 1024, 4096), steps=8)
SMOKE = dict(moe=dict(hidden=64, inter=32, experts=16, top_k=4, tokens=(64,)),
             moe_model=dict(MOE_MODEL, hidden_size=64, intermediate_size=32, num_local_experts=8,
                            vocab_size=256, tokens=64),
             attention=dict(ATTENTION, seqs=(128, 256)),
             decode=dict(DECODE, hidden_size=64, intermediate_size=128, vocab_size=256, contexts=(32, 64), steps=2))


def timed(fn, args, repeat: int) -> float:
    """Median seconds of ``fn(*args)`` over ``repeat`` calls, after one untimed (compiling) call."""
    return statistics.median(harness.times(lambda: jax.block_until_ready(fn(*args)), repeat))


def compiled_stats(fn, args):
    """``jax.jit(fn)`` compiled for ``args`` (timed and run as it is: compiled once), with XLA's own
    analyses: ``(compiled, flops, temp bytes)``."""
    compiled = jax.jit(fn).lower(*args).compile()
    return compiled, float(compiled.cost_analysis()["flops"]), int(compiled.memory_analysis().temp_size_in_bytes)


# --- MoE -------------------------------------------------------------------------------------------


def _moe_problem(hidden: int, inter: int, experts: int, top_k: int, tokens: int, seed: int = 0):
    rng = np.random.default_rng(seed)

    def w(*shape):
        return jnp.asarray(rng.normal(size=shape) * shape[-1] ** -0.5, jnp.float32)

    params = {"router": w(experts, hidden), "gate": {"kernel": w(experts, inter, hidden)},
              "up": {"kernel": w(experts, inter, hidden)}, "down": {"kernel": w(experts, hidden, inter)}}
    cfg = mixtral_config({"model_type": "mixtral", "vocab_size": 8, "hidden_size": hidden, "intermediate_size": inter,
                          "num_hidden_layers": 1, "num_attention_heads": 1, "num_local_experts": experts,
                          "num_experts_per_tok": top_k})
    return params, jnp.asarray(rng.normal(size=(tokens, hidden)), jnp.float32), cfg


def _moe_fn(impl: str, cfg):
    def fn(params, x):
        weights, idx = route(x @ params["router"].T, cfg)
        experts = {k: params[k] for k in ("gate", "up", "down")}
        return expert_ffn(x, idx, weights, experts, in_first=False, activation=lambda g, u: jax.nn.silu(g) * u,
                          impl=impl)
    return fn


def _occupied_blocks(params, x, cfg) -> tuple[int, int]:
    """``(blocks the routing occupies, block rows)`` for the blocks implementation."""
    _, idx = route(x @ params["router"].T, cfg)
    sizes = np.bincount(np.asarray(idx).ravel(), minlength=cfg.num_experts)
    block = block_size(idx.size, cfg.num_experts)
    return int((-(-sizes // block)).sum()), block


def _block_step_flops(params, block: int) -> float:
    """XLA's FLOPs for one loop step of the blocks implementation: one expert on ``block`` rows."""
    def step(h, g, u, d):
        return (jax.nn.silu(h @ g.T) * (h @ u.T)) @ d.T
    h = jnp.zeros((block, params["gate"]["kernel"].shape[2]), jnp.float32)
    return compiled_stats(step, (h, params["gate"]["kernel"][0], params["up"]["kernel"][0],
                                 params["down"]["kernel"][0]))[1]


def bench_moe(shapes: dict, model_shapes: dict, repeat: int) -> None:
    print(f"\n## MoE feed-forward: hidden {shapes['hidden']}, expert inter {shapes['inter']}, "
          f"{shapes['experts']} experts, top {shapes['top_k']}\n")
    print(harness.table(["tokens", "impl", "ms (median)", "XLA temp MiB", "FLOPs executed (G)", "FLOPs / dense",
                         "max abs diff / dense"], [], left=2))  # fmt: skip
    for tokens in shapes["tokens"]:
        params, x, cfg = _moe_problem(shapes["hidden"], shapes["inter"], shapes["experts"], shapes["top_k"], tokens)
        ref = None
        dense_flops = None
        for impl in (DENSE, BLOCKS, RAGGED):
            if impl == RAGGED and tokens > shapes["tokens"][0]:
                continue  # a masked dense dot on CPU (4x dense FLOPs): once is enough
            fn, flops, temp = compiled_stats(_moe_fn(impl, cfg), (params, x))
            if impl == BLOCKS:  # the loop body is counted once: add the other occupied blocks
                blocks, block = _occupied_blocks(params, x, cfg)
                flops += (blocks - 1) * _block_step_flops(params, block)
            seconds = timed(fn, (params, x), repeat)
            out = np.asarray(fn(params, x))
            ref = out if ref is None else ref
            dense_flops = flops if dense_flops is None else dense_flops
            print(harness.row([tokens, impl, f"{seconds * 1e3:.1f}", f"{temp / MIB:.1f}", f"{flops / 1e9:.2f}",
                               f"{flops / dense_flops:.3f}", f"{np.abs(out - ref).max():.1e}"]))  # fmt: skip
    ideal = 2 * 3 * shapes["hidden"] * shapes["inter"] * shapes["top_k"]
    print(f"\nIdeal expert FLOPs per token: 2 × 3 matmuls × {shapes['hidden']} × {shapes['inter']} × top "
          f"{shapes['top_k']} = {ideal / 1e6:.1f} M (dense: × {shapes['experts']} / {shapes['top_k']}).")
    bench_moe_model(model_shapes, repeat)


def bench_moe_model(shapes: dict, repeat: int) -> None:
    tokens = shapes["tokens"]
    hf = {"model_type": "mixtral", **{k: v for k, v in shapes.items() if k != "tokens"}}
    model = MoeForCausalLM(mixtral_config(hf), scan_layers=True, rngs=nnx.Rngs(0))
    ids = jnp.asarray(np.random.default_rng(0).integers(0, hf["vocab_size"], (1, tokens)))
    print(f"\n## MoE model forward: Mixtral-shaped, {hf['num_hidden_layers']} layers (scanned), hidden "
          f"{hf['hidden_size']}, {hf['num_local_experts']} experts of {hf['intermediate_size']}, top "
          f"{hf['num_experts_per_tok']}, 1 × {tokens} tokens\n")
    print(harness.table(["moe_impl", "ms (median)", "XLA temp MiB"], []))
    for impl in (DENSE, BLOCKS):
        model.moe_impl = impl
        forward, _, temp = compiled_stats(lambda m, i: m(i), (model, ids))
        seconds = timed(forward, (model, ids), repeat)
        print(harness.row([impl, f"{seconds * 1e3:.1f}", f"{temp / MIB:.1f}"]))


# --- attention -------------------------------------------------------------------------------------


def eager_attention(q, k, v, scale: float):
    """The former model code: KV heads repeated, full f32 logits, causal mask."""
    groups = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, groups, axis=2), jnp.repeat(v, groups, axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) * scale
    s = q.shape[1]
    mask = jnp.arange(s)[None, :] <= jnp.arange(s)[:, None]
    logits = jnp.where(mask[None, None], logits, jnp.finfo(jnp.float32).min)
    return jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(logits, axis=-1).astype(v.dtype), v)


def _attention_fn(method: str, scale: float):
    if method == "eager":
        return lambda q, k, v: eager_attention(q, k, v, scale)
    impl = CHUNKED if method == "chunked" else DPA

    def fn(q, k, v):
        ctx = Context(positions=None, q_index=jnp.arange(q.shape[1]), kv_mask=None, attention_impl=impl)
        return attention(q, k, v, ctx, scale=scale)
    return fn


def bench_attention(shapes: dict, repeat: int, max_temp_gib: float) -> None:
    heads, kv_heads, dim = shapes["heads"], shapes["kv_heads"], shapes["dim"]
    print(f"\n## Attention: 1 × s tokens, {heads} query heads, {kv_heads} KV heads, head dim {dim}, causal\n")
    print(harness.table(["tokens", "method", "ms (median)", "XLA temp MiB", "temp / tokens (KiB)"], [], left=2))
    rng = np.random.default_rng(0)
    for seq in shapes["seqs"]:
        q = jnp.asarray(rng.normal(size=(1, seq, heads, dim)), jnp.float32)
        k, v = (jnp.asarray(rng.normal(size=(1, seq, kv_heads, dim)), jnp.float32) for _ in range(2))
        for method in ("chunked", "eager", "dpa"):
            fn = _attention_fn(method, dim**-0.5)
            compiled, _, temp = compiled_stats(fn, (q, k, v))
            runs = temp <= max_temp_gib * GIB
            seconds = f"{timed(compiled, (q, k, v), repeat) * 1e3:.1f}" if runs else "not run"
            print(harness.row([seq, method, seconds, f"{temp / MIB:.1f}", f"{temp / 1024 / seq:.1f}"]))


# --- decode ----------------------------------------------------------------------------------------


def bench_decode(shapes: dict, repeat: int) -> None:
    hf = {"model_type": "llama", **{k: v for k, v in shapes.items() if k not in ("contexts", "steps")}}
    model = LlamaForCausalLM(LlamaConfig.from_hf(hf), rngs=nnx.Rngs(0))
    steps = shapes["steps"]
    print(f"\n## Decoding: Llama-shaped, {hf['num_hidden_layers']} layers, hidden {hf['hidden_size']}, batch 1; "
          f"time per new token\n")
    print(harness.table(["context", "with KV cache (ms / token)", "full recompute (ms / token)", "recompute / cache"],
                        [], left=0))  # fmt: skip
    step = jax.jit(lambda m, i, p, c: m.run(i, None, p, c, last_only=True), donate_argnums=(3,))
    full = jax.jit(lambda m, i: m.run(i, last_only=True)[0])
    rng = np.random.default_rng(0)
    for context in shapes["contexts"]:
        ids = jnp.asarray(rng.integers(0, hf["vocab_size"], (1, context + steps)))
        cache = model.init_cache(1, context + steps)
        _, cache = step(model, ids[:, :context], jnp.arange(context)[None], cache)
        token = ids[:, context : context + 1]
        jax.block_until_ready(step(model, token, jnp.full((1, 1), context), model.init_cache(1, context + steps)))
        per_token = []
        for t in range(steps):
            start = time.perf_counter()
            logits, cache = step(model, ids[:, context + t : context + t + 1], jnp.full((1, 1), context + t), cache)
            jax.block_until_ready(logits)
            per_token.append(time.perf_counter() - start)
        cached = statistics.median(per_token)
        recompute = timed(full, (model, ids[:, : context + 1]), repeat)
        print(harness.row([context, f"{cached * 1e3:.2f}", f"{recompute * 1e3:.1f}", f"{recompute / cached:.0f}×"]))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", default="moe,attention,decode", help="comma-separated: moe, attention, decode")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--max-temp-gib", type=float, default=6.0, help="skip running methods needing more")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (the harness's own test)")
    args = parser.parse_args(argv)
    sections = set(args.sections.split(","))
    shapes = SMOKE if args.smoke else dict(moe=MOE, moe_model=MOE_MODEL, attention=ATTENTION, decode=DECODE)
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, {len(jax.devices())} device(s)")
    if "moe" in sections:
        bench_moe(shapes["moe"], shapes["moe_model"], args.repeat)
    if "attention" in sections:
        bench_attention(shapes["attention"], args.repeat, args.max_temp_gib)
    if "decode" in sections:
        bench_decode(shapes["decode"], args.repeat)


if __name__ == "__main__":
    main()
