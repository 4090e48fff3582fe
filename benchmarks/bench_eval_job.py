"""An ``otfload eval`` job end to end against the same job in transformers, first and repeated run.

    python -m benchmarks.bench_eval_job                        # on an accelerator: issue 31's job
    python -m benchmarks.bench_eval_job --platform cpu --preset tiny --texts 16   # a dry run anywhere

Issue 31's job: a random Llama-shaped checkpoint (``--preset 1b``: TinyLlama's shape, 1.1 B
parameters, bf16; ``benchmarks.make_checkpoint``) with ``benchmarks.bench_eval``'s BPE tokenizer, and
``--texts`` texts of 64 to 1,000 words (standard-library source lines, seeded), each scored on its
first ``--max-len`` ids in batches of ``--batch-size``. Every job is a fresh child process, timed
from its start to its exit as a user waits for it:

* ``otfload eval ... --json``, twice with one fresh ``--compile-cache``: the first job compiles, the
  second finds its programs kept (``otfload.programs``);
* transformers as its users run it at its fastest sensible: ``AutoModelForCausalLM`` in bf16 on
  the accelerator (SDPA attention), ``AutoTokenizer`` cut to the same first ``--max-len`` ids, texts
  sorted by length into batches of ``--batch-size`` padded on the right, the summed cross-entropy
  of each batch's next-token predictions under ``torch.inference_mode``.

Printed: each job's wall time and its own load / compile / scoring split, predicted tokens and
tokens per second of scoring, NLL per token (both jobs predict the same tokens; bf16 sums agree to
about 1e-3), and issue 31's targets: first job ≤ 1.0× transformers' wall, repeated job ≤ 0.5×,
scoring throughput ≥ 5×.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

from benchmarks import harness
from benchmarks.bench_eval import PRESETS, build_tokenizer, corpus_lines, write_tokenizer_config
from benchmarks.bench_lm_eval import child
from benchmarks.make_checkpoint import ensure_written

ROOT = Path("bench_data") / "eval_job"
WORDS = (64, 1000)  # each text's length in words, drawn uniformly (issue 31's job)

TRANSFORMERS_CHILD = """
import json, sys, time
start = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
ckpt, data, max_len, batch, device = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
texts = [json.loads(line)["text"] for line in open(data)]
tokenizer = AutoTokenizer.from_pretrained(ckpt)
model = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).to(device).eval()
if device == "cuda":
    torch.cuda.synchronize()
loaded = time.perf_counter()
ids = [tokenizer(t, truncation=True, max_length=max_len)["input_ids"] for t in texts]
order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
nll, tokens = 0.0, 0
with torch.inference_mode():
    for k in range(0, len(order), batch):
        rows = [ids[i] for i in order[k : k + batch]]
        width = max(len(r) for r in rows)
        x = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros_like(x)
        for r, row in enumerate(rows):
            x[r, : len(row)], mask[r, : len(row)] = torch.tensor(row), 1
        x, mask = x.to(device), mask.to(device)
        logits = model(input_ids=x, attention_mask=mask).logits[:, :-1].float()
        labels = x[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        nll += float(torch.nn.functional.cross_entropy(logits.transpose(1, 2), labels, reduction="sum"))
        tokens += int((labels != -100).sum())
end = time.perf_counter()
print(json.dumps({"load_seconds": loaded - start, "score_seconds": end - loaded, "tokens": tokens,
                  "nll_per_token": nll / tokens}))
"""


def write_texts(path: Path, texts: int, seed: int = 0) -> Path:
    """``texts`` JSONL texts of ``WORDS`` words each (drawn uniformly), from standard-library sources."""
    rng = random.Random(seed)
    words = " ".join(corpus_lines()).split()
    with open(path, "w") as f:
        for _ in range(texts):
            n = rng.randint(*WORDS)
            start = rng.randrange(len(words) - n)
            f.write(json.dumps({"text": " ".join(words[start : start + n])}) + "\n")
    return path


def checkpoint(root: Path, preset: str) -> Path:
    """The preset's checkpoint under ``root`` with a BPE ``tokenizer.json`` and a
    ``tokenizer_config.json`` (transformers' ``AutoTokenizer`` reads it), written once."""
    dims = PRESETS[preset]
    out = ensure_written(root / preset, dims)
    if not (out / "tokenizer.json").exists():
        build_tokenizer(out / "tokenizer.json", dims.vocab, corpus_lines())
    write_tokenizer_config(out)
    return out


def run(command: list[str], env: dict[str, str]) -> tuple[float, dict]:
    """``(wall seconds from start to exit, the JSON object its stdout ends with)``."""
    wall, stdout = child(command, env)
    return wall, json.loads(stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="1b")
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--platform", choices=("gpu", "cpu"), default="gpu",
                        help="gpu: JAX's default backend and torch on cuda; cpu: both on the CPU (a dry run)")
    parser.add_argument("--json", type=Path, help="write the figures here too")
    parser.add_argument("--out", type=Path, default=ROOT, help=f"checkpoints and texts (default: {ROOT})")
    args = parser.parse_args(argv)
    ckpt = checkpoint(args.out, args.preset).resolve()
    data = write_texts(args.out / f"texts-{args.texts}.jsonl", args.texts).resolve()
    env = harness.child_env(1 if args.platform == "cpu" else None, args.platform)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(harness.ROOT), env.get("PYTHONPATH")) if p)
    jobs: dict[str, tuple[float, dict]] = {}
    with tempfile.TemporaryDirectory(prefix="otfload-xla-") as cache:
        for name in ("otfload, first job", "otfload, repeated job"):
            jobs[name] = run([sys.executable, "-m", "otfload.cli", "eval", str(ckpt), "--data", str(data), "--max-len",
                              str(args.max_len), "--batch-size", str(args.batch_size), "--compile-cache", cache,
                              "--no-progress", "--json"], env)  # fmt: skip
    device = "cuda" if args.platform == "gpu" else "cpu"
    jobs["transformers"] = run([sys.executable, "-c", TRANSFORMERS_CHILD, str(ckpt), str(data), str(args.max_len),
                                str(args.batch_size), device], env)  # fmt: skip
    reference_wall, reference = jobs["transformers"]
    rows = []
    for name, (wall, r) in jobs.items():
        rate = r["tokens"] / r["score_seconds"] if "score_seconds" in r else r["tokens_per_second"]
        score = r.get("score_seconds", r.get("eval_seconds", 0.0) - r.get("compile_seconds", 0.0))
        rows.append([name, f"{wall:.1f}", f"{wall / reference_wall:.2f}", f"{r['load_seconds']:.2f}",
                     f"{r.get('compile_seconds', 0.0):.2f}", f"{score:.2f}", r["tokens"], f"{rate:,.0f}",
                     f"{r['nll_per_token']:.4f}"])  # fmt: skip
    print(f"\n{harness.machine_line()}; preset {args.preset}, {args.texts} texts, max-len {args.max_len}, "
          f"batch {args.batch_size}, {args.platform}")
    print(harness.table(["job", "wall s", "/ transformers", "load s", "compile s", "scoring s", "tokens",
                         "tokens/s", "NLL per token"], rows))  # fmt: skip
    first, repeated = (jobs[n][0] / reference_wall for n in ("otfload, first job", "otfload, repeated job"))
    speed = jobs["otfload, first job"][1]["tokens_per_second"] / (reference["tokens"] / reference["score_seconds"])
    verdicts = [("first job ≤ 1.0× transformers' wall", first, first <= 1.0),
                ("repeated job ≤ 0.5× transformers' wall", repeated, repeated <= 0.5),
                ("scoring throughput ≥ 5× transformers'", speed, speed >= 5.0)]
    print(harness.table(["issue 31 target", "measured", "met"], [[t, f"{v:.2f}x", m] for t, v, m in verdicts]))
    if args.json:
        args.json.write_text(json.dumps({"jobs": {n: {"wall": w, **r} for n, (w, r) in jobs.items()},
                                         "targets": {t: v for t, v, _ in verdicts}}, indent=1))


if __name__ == "__main__":
    main()
