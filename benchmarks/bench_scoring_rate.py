"""How close the lm_eval backend's scoring runs to this machine's float32 matmul rate.

    python -m benchmarks.bench_scoring_rate                  # the 1,000-question task of bench_lm_eval

The job is ``benchmarks.bench_lm_eval``'s multiple-choice task on its ``tiny`` checkpoint, scored by
``OtfloadLM`` in this process (one CPU device, float32). lm_eval builds the requests once; then:

* the job's scoring (``Scorer.score`` of its groups, programs compiled) timed again, wall and CPU;
* one batch of the job's shape: the whole scoring step, the model's forward alone (every slot of
  the batch) and the output projection of the scored slots alone (log-softmax included and not);
* a plain ``[scored, hidden] @ [hidden, vocab]`` float32 matmul, in JAX and in torch (each at its
  default threads): the rate the machine's BLAS reaches on the job's largest product.

Printed: seconds and GFLOP/s of each (the FLOPs counted from the shapes: 2 per multiply-add of the
layers' projections and of attention's two products on every slot, of the output projection on
every scored slot), and the scoring time the job's FLOPs would take at the plain
matmul's rate: the floor no arrangement of the same arithmetic goes below on these cores.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from benchmarks import harness
from benchmarks.bench_lm_eval import ROOT, checkpoint, make_task

REPEAT = 5  # timed calls per measurement (after one warm-up); the median is printed


def median_seconds(fn: Callable[[], object]) -> float:
    values = sorted(harness.times(fn, REPEAT))
    return values[len(values) // 2]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=1000)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    ckpt = checkpoint("tiny").resolve()
    tasks = make_task(ROOT / f"mc-{args.questions}", args.questions).resolve()

    import jax
    import jax.numpy as jnp
    import lm_eval
    import numpy as np
    import torch
    from lm_eval.tasks import TaskManager

    from otfload.lm_eval import OtfloadLM
    from otfload.lm_eval.scoring import _loglik_of_batch

    config = json.loads((Path(ckpt) / "config.json").read_text())
    hidden, inter, layers, vocab = (config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                                         "vocab_size"))
    heads, kv_heads, head_dim = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    per_slot = 2 * layers * (hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter)

    lm = OtfloadLM(str(ckpt), dtype="float32", batch_size=16)
    scorer, captured = lm.scorer, []
    score = scorer.score
    scorer.score = lambda groups, *rest: captured.append(groups) or score(groups, *rest)  # type: ignore[method-assign]
    manager = TaskManager(include_path=str(tasks), include_defaults=False)
    lm_eval.simple_evaluate(model=lm, tasks=["bench_mc"], task_manager=manager)
    groups, model = captured[0], lm.model
    batches = scorer.plan(groups)
    b, w, n = shape = batches[0][1]
    attention_per_row = 4 * layers * w * w * heads * head_dim  # scores and weighted values, every slot pair
    slots, scored = len(batches) * b * w, len(batches) * n
    job_flops = slots * per_slot + len(batches) * (b * attention_per_row + n * 2 * hidden * vocab)

    cpu = time.process_time()
    job = median_seconds(lambda: score(groups, lambda: model))
    job_cpu = (time.process_time() - cpu) / (REPEAT + 1)

    rng = np.random.default_rng(0)
    ids = jnp.asarray(rng.integers(0, vocab, (b, w)), jnp.int32)
    mask, ones = jnp.ones((b, w), bool), jnp.ones((b, w), jnp.int32)
    positions = jnp.tile(jnp.arange(w, dtype=jnp.int32), (b, 1))
    at, targets = (jnp.asarray(rng.integers(0, high, n), jnp.int32) for high in (b * w, vocab))
    step = jax.jit(_loglik_of_batch)
    whole = median_seconds(lambda: jax.block_until_ready(step(model, ids, mask, positions, ones, ones, at, targets)))

    from otfload.models.attention import make_context

    def forward(m: OtfloadLM, ids: jax.Array) -> jax.Array:
        ctx = make_context(ids, mask, positions, None, m.attention_impl, m.moe_impl, (ones, ones))
        return m.forward(ids, ctx, None)[0]

    forward_jit = jax.jit(forward)
    states = forward_jit(model, ids)
    picked = states.reshape(-1, hidden)[at][None]
    head = jax.jit(lambda m, x: jax.nn.log_softmax(m.head(x)[0].astype(jnp.float32), axis=-1))
    head_only = jax.jit(lambda m, x: m.head(x)[0])
    a = rng.standard_normal((n, hidden), np.float32)
    w_out = rng.standard_normal((hidden, vocab), np.float32)
    matmul = jax.jit(jnp.matmul)
    ta, tw = torch.from_numpy(a), torch.from_numpy(w_out)
    timed = {
        "scoring step, one batch": (whole, b * (w * per_slot + attention_per_row) + n * 2 * hidden * vocab),
        "forward alone (every slot)": (median_seconds(lambda: jax.block_until_ready(forward_jit(model, ids))),
                                       b * (w * per_slot + attention_per_row)),
        "output projection + log-softmax (scored slots)": (
            median_seconds(lambda: jax.block_until_ready(head(model, picked))), n * 2 * hidden * vocab),
        "output projection alone": (median_seconds(lambda: jax.block_until_ready(head_only(model, picked))),
                                    n * 2 * hidden * vocab),
        "plain matmul, JAX": (median_seconds(lambda: jax.block_until_ready(matmul(a, w_out))), n * 2 * hidden * vocab),
        f"plain matmul, torch ({torch.get_num_threads()} threads)": (median_seconds(lambda: ta @ tw),
                                                                       n * 2 * hidden * vocab),
    }
    peak = max(flops / seconds for seconds, flops in timed.values())
    print(f"\n{harness.machine_line()}")
    print(f"job: {len(batches)} batches of {shape}, {slots} slots, {scored} scored, {job_flops / 1e9:.0f} GFLOP")
    rows = [[name, f"{seconds * 1e3:.1f}", f"{flops / seconds / 1e9:.0f}"] for name, (seconds, flops) in timed.items()]
    rows.append(["the job's scoring (all batches)", f"{job * 1e3:.0f} ({job_cpu:.1f} CPU s)",
                 f"{job_flops / job / 1e9:.0f}"])
    print(harness.table(["measured", "ms (median)", "GFLOP/s"], rows))
    print(f"the job's FLOPs at the best rate above ({peak / 1e9:.0f} GFLOP/s): {job_flops / peak:.2f} s; "
          f"measured {job:.2f} s ({job_flops / peak / job:.0%} of that rate)")


if __name__ == "__main__":
    main()
