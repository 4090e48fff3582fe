"""lm-evaluation-harness jobs, otfload's backend against lm_eval's ``hf`` backend, and how fast a job starts.

    python -m benchmarks.bench_lm_eval                       # all three parts, ~10 min on 2 busy cores
    python -m benchmarks.bench_lm_eval --questions 200 --parts hf
    python -m benchmarks.bench_lm_eval --parts overlap --preset small  # a 160 M model: a longer load
    python -m benchmarks.bench_lm_eval --parts backends                # the two backends alone, same task index

The checkpoint is ``benchmarks.bench_eval``'s ``tiny`` preset (``--preset``; a random Llama-shaped
model, 13 M parameters, bf16 on disk, scored in float32 by both backends) with its BPE tokenizer and a
``tokenizer_config.json``; the task is a multiple-choice task in lm_eval's YAML format over a local
JSONL file of ``--questions`` questions (standard-library source lines, four continuations each),
so ``4 × questions`` loglikelihood requests. Every job runs in a fresh child process, as a user
would start it, on the machine's CPU (one JAX device; torch with its default threads).

Parts:

* ``hf``: ``otfload lm-eval ... --json`` against lm_eval's own command line with ``--model hf``
  (``dtype=float32``, same batch size): wall time of each job end to end, and both backends'
  ``acc`` / ``acc_norm``. otfload runs with its compilation cache off (a first run). Each command
  line as it runs: ``otfload lm-eval`` indexes only ``--include-path`` when every task named is
  there; lm_eval's indexes its ~14k built-in task files too (it has no flag to skip them). Then
  lm_eval's command line with ``--model otfload`` (``python -m otfload.lm_eval run``), twice with one
  fresh ``$OTFLOAD_COMPILE_CACHE``: a first job and a repeated one (its programs kept by default).
* ``backends``: the backends alone, on equal terms: each in a fresh process through
  ``lm_eval.simple_evaluate`` with the same task index (the include path only, lm_eval's
  ``TaskManager(include_defaults=False)``), ``--rounds`` rounds alternating, medians of each
  process's wall and CPU seconds (user + system, every thread). otfload's ``batch_size`` counts
  rows, and a row holds a whole question (its choices packed after it); ``--hf-batch`` gives the
  hf backend another batch size (requests) to compare at its own best. A third process, the
  ``floor``, runs the same job with a model that answers every request at once (no model, no
  tokenizer): lm_eval's own part of either job (imports, torch seeding, building and scoring the
  task's documents), so the table also gives the ratio of what each backend adds to it.
* ``cache``: the same ``otfload lm-eval`` job twice with a fresh ``--compile-cache`` directory:
  the ``compile_seconds`` of each (tracing + lowering + XLA compilation, or loading the programs
  the first job kept: ``otfload.programs``), its tracing + lowering part, the CPU seconds of each
  job, and whether the two jobs' results are equal; for the multiple-choice task, then for a
  ``generate_until`` task (``bench_gen``: ``GEN_PROMPTS`` source-line prompts, greedy, ``GEN_TOKENS``
  new tokens, stop at a newline or a period), whose compile time is its prefill and decoding steps'.
* ``overlap``: in a child process, the backend is built (weights loading on their thread) and the
  scoring step compiled for ``--widths`` either after the load ends (sequential) or while it runs
  (overlapped): the wall time from construction to "weights in and shapes compiled", against the
  load and compile times of the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.bench_eval import PRESETS, build, corpus_lines, write_tokenizer_config

ROOT = Path("bench_data") / "lm_eval"
BATCH = 16
GEN_PROMPTS, GEN_TOKENS = 64, 32  # the cache part's generate_until job: 4 batches, a few prompt widths
WIDTHS = (64, 128, 192, 256)  # the overlap part's widths (16 scored positions): what a multiple-choice job compiles
OVERLAP_CHILD = """
import json, sys, time
from otfload.lm_eval import OtfloadLM
from otfload.lm_eval.scoring import Shape
overlapped, batch = sys.argv[1] == "overlapped", int(sys.argv[4])
widths = [Shape(batch, int(w), 16) for w in sys.argv[2].split(",")]
start = time.perf_counter()
lm = OtfloadLM(sys.argv[3], dtype="float32", batch_size=batch)
if overlapped:
    lm.scorer.compile(widths)  # against the abstract model, while the weights load
    lm.model
else:
    lm.scorer.compile(widths, lm.model)  # against the loaded model, after the load
ready = time.perf_counter() - start
print(json.dumps({"ready": ready, **lm.timings.to_dict()}))
"""


BACKEND_CHILD = """
import json, resource, sys, time
start = time.perf_counter()
import lm_eval
from lm_eval.tasks import TaskManager
backend, ckpt, tasks, batch = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
manager = TaskManager(include_path=tasks, include_defaults=False)
if backend == "hf":
    from lm_eval.models.huggingface import HFLM
    model = HFLM(pretrained=ckpt, batch_size=batch, device="cpu", dtype="float32")
elif backend == "floor":  # lm_eval's own part of a job: every request answered at once, no model or tokenizer
    from lm_eval.api.model import LM
    class Floor(LM):
        def loglikelihood(self, requests, disable_tqdm=False): return [(0.0, False)] * len(requests)
        def loglikelihood_rolling(self, requests, disable_tqdm=False): return [0.0] * len(requests)
        def generate_until(self, requests, disable_tqdm=False): return [""] * len(requests)
    model = Floor()
else:
    from otfload.lm_eval import OtfloadLM
    model = OtfloadLM(ckpt, dtype="float32", batch_size=batch)
out = lm_eval.simple_evaluate(model=model, tasks=["bench_mc"], task_manager=manager)
metrics = out["results"]["bench_mc"]
usage = resource.getrusage(resource.RUSAGE_SELF)
timings = model.timings.to_dict() if backend == "otfload" else {}
print(json.dumps({"wall": time.perf_counter() - start, "cpu": usage.ru_utime + usage.ru_stime,
                  "acc": metrics["acc,none"], "acc_norm": metrics["acc_norm,none"], **timings}))
"""


def make_task(root: Path, questions: int, seed: int = 0) -> Path:
    """A ``bench_mc`` task of ``questions`` four-way questions; returns its include path."""
    rng = random.Random(seed)
    lines = [line for line in corpus_lines() if 8 <= len(line) <= 120]
    root.mkdir(parents=True, exist_ok=True)
    with open(root / "mc.jsonl", "w") as f:
        for _ in range(questions):
            question, *choices = rng.sample(lines, 5)
            f.write(json.dumps({"question": question, "choices": [c[:40] for c in choices],
                                "answer": rng.randrange(4)}) + "\n")
    (root / "bench_mc.yaml").write_text(
        "task: bench_mc\ndataset_path: json\ntest_split: test\n"
        f"dataset_kwargs:\n  data_files:\n    test: {(root / 'mc.jsonl').resolve()}\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    return root


def make_gen_task(root: Path, prompts: int = GEN_PROMPTS, seed: int = 0) -> str:
    """A ``bench_gen`` task (``generate_until``) of ``prompts`` source lines under ``root``; returns its name."""
    rng = random.Random(seed)
    lines = rng.sample([line for line in corpus_lines() if 8 <= len(line) <= 120], prompts)
    (root / "gen.jsonl").write_text("".join(json.dumps({"prompt": line, "answer": ""}) + "\n" for line in lines))
    (root / "bench_gen.yaml").write_text(
        "task: bench_gen\ndataset_path: json\ntest_split: test\n"
        f"dataset_kwargs:\n  data_files:\n    test: {(root / 'gen.jsonl').resolve()}\n"
        "output_type: generate_until\ndoc_to_text: \"{{prompt}}\"\ndoc_to_target: \"{{answer}}\"\n"
        f"generation_kwargs:\n  until: [\"\\n\", \".\"]\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return "bench_gen"


def checkpoint(preset: str) -> Path:
    """A ``benchmarks.bench_eval`` preset with a ``tokenizer_config.json`` naming its special tokens."""
    path, _ = build(preset, texts=1, length=16)
    write_tokenizer_config(path)
    return path


def child(command: list[str], env: dict[str, str] | None = None) -> tuple[float, str]:
    """Run ``command``; ``(wall seconds, stdout)``."""
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    wall = time.perf_counter() - start
    if out.returncode:
        sys.exit(f"{command[:4]} failed:\n{out.stderr[-4000:]}")
    return wall, out.stdout


def otfload_job(ckpt: Path, tasks: Path, cache: str, env: dict[str, str], task: str = "bench_mc"
                ) -> tuple[float, dict]:
    wall, stdout = child([sys.executable, "-m", "otfload.cli", "lm-eval", str(ckpt), "--tasks", task,
                          "--include-path", str(tasks), "--dtype", "float32", "--batch-size", str(BATCH),
                          "--compile-cache", cache, "--no-progress", "--json"], env)
    return wall, json.loads(stdout)


def lm_eval_job(model: str, ckpt: Path, tasks: Path, env: dict[str, str], out_dir: Path) -> tuple[float, dict]:
    """lm_eval's own command line with ``--model hf`` or ``otfload`` (``python -m otfload.lm_eval``:
    lm_eval's CLI with the otfload model registered); wall seconds and lm_eval's ``results``."""
    module = "otfload.lm_eval" if model == "otfload" else "lm_eval"
    wall, _ = child([sys.executable, "-m", module, "run", "--model", model, "--model_args",
                     f"pretrained={ckpt},dtype=float32", "--device", "cpu", "--batch_size", str(BATCH),
                     "--tasks", "bench_mc", "--include_path", str(tasks), "--output_path", str(out_dir)], env)
    results = json.loads(next(out_dir.rglob("results_*.json")).read_text())
    return wall, results["results"]


def part_hf(ckpt: Path, tasks: Path, env: dict[str, str], questions: int) -> None:
    ours_wall, ours = otfload_job(ckpt, tasks, "off", env)
    with tempfile.TemporaryDirectory() as tmp:
        hf_wall, theirs = lm_eval_job("hf", ckpt, tasks, env, Path(tmp) / "hf")
        # lm_eval's command line with each backend; otfload's keeps its programs (a fresh directory):
        # its first job compiles, a second one, as a user repeats it, loads them
        cli_env = {**env, "OTFLOAD_COMPILE_CACHE": str(Path(tmp) / "xla")}
        cli = [lm_eval_job("otfload", ckpt, tasks, cli_env, Path(tmp) / f"otfload{i}") for i in range(2)]
    a, b = ours["results"]["bench_mc"], theirs["bench_mc"]
    t = ours["timings"]
    print(f"\n{questions} questions ({4 * questions} loglikelihood requests), batch {BATCH}, float32")
    rows = [["otfload", f"{ours_wall:.1f}", f"{a['acc,none']:.4f}", f"{a['acc_norm,none']:.4f}",
             f"{t['load_seconds']:.1f}", f"{t['compile_seconds']:.1f}", f"{t['score_seconds']:.1f}"],
            ["hf", f"{hf_wall:.1f}", f"{b['acc,none']:.4f}", f"{b['acc_norm,none']:.4f}", "", "", ""]]  # fmt: skip
    print(harness.table(["backend", "job wall s", "acc", "acc_norm", "load s", "compile s", "score s"], rows))
    print(f"hf / otfload wall: {hf_wall / ours_wall:.2f}x; metrics equal: "
          f"{(a['acc,none'], a['acc_norm,none']) == (b['acc,none'], b['acc_norm,none'])}")
    rows = [[f"lm_eval run --model otfload, job {i}", f"{wall:.1f}", f"{hf_wall / wall:.2f}",
             f"{r['bench_mc']['acc,none']:.4f}", f"{r['bench_mc']['acc_norm,none']:.4f}"]
            for i, (wall, r) in enumerate(cli, 1)]  # fmt: skip
    rows.append(["lm_eval run --model hf", f"{hf_wall:.1f}", "1.00", f"{b['acc,none']:.4f}",
                 f"{b['acc_norm,none']:.4f}"])
    print(harness.table(["lm_eval's own command line", "job wall s", "hf / this", "acc", "acc_norm"], rows))


def part_cache(ckpt: Path, tasks: Path, env: dict[str, str]) -> None:
    for task in ("bench_mc", make_gen_task(tasks)):
        cache_twice(ckpt, tasks, env, task)


def cache_twice(ckpt: Path, tasks: Path, env: dict[str, str], task: str) -> None:
    """The ``cache`` part for one task: two jobs sharing a fresh ``--compile-cache``."""
    cache = Path(tempfile.mkdtemp(prefix="otfload-xla-"))
    load_before, runs = os.getloadavg()[0], []
    try:
        for _ in range(2):
            before = os.times()
            wall, result = otfload_job(ckpt, tasks, str(cache), env, task)
            after = os.times()
            cpu = after.children_user + after.children_system - before.children_user - before.children_system
            runs.append((wall, cpu, result))
    finally:
        shutil.rmtree(cache)
    print(f"\n{task}: load average {load_before:.2f} before, {os.getloadavg()[0]:.2f} after")
    timings = [r["timings"] for _, _, r in runs]
    rows = [[i, f"{wall:.1f}", f"{cpu:.1f}", f"{t['compile_seconds']:.2f}", f"{t['lower_seconds']:.2f}",
             f"{t['score_seconds'] + t['generate_seconds']:.2f}"]
            for i, ((wall, cpu, _), t) in enumerate(zip(runs, timings, strict=True), 1)]  # fmt: skip
    print(harness.table(["run", "job wall s", "job CPU s", "compile s", "of which tracing + lowering s",
                         "score + generate s"], rows))
    same = runs[0][2]["results"] == runs[1][2]["results"]
    print(f"second / first compile: {timings[1]['compile_seconds'] / timings[0]['compile_seconds']:.1%}; "
          f"results equal: {same}")


def part_backends(ckpt: Path, tasks: Path, env: dict[str, str], rounds: int, hf_batch: int) -> None:
    runs: dict[str, list[dict]] = {"otfload": [], "hf": [], "floor": []}
    batches = {"otfload": BATCH, "hf": hf_batch, "floor": 0}
    for _ in range(rounds):
        for backend in runs:
            _, stdout = child([sys.executable, "-c", BACKEND_CHILD, backend, str(ckpt), str(tasks),
                               str(batches[backend])], env)
            runs[backend].append(json.loads(stdout.strip().splitlines()[-1]))
    walls = {b: sorted(r["wall"] for r in rs) for b, rs in runs.items()}
    median = {b: w[len(w) // 2] for b, w in walls.items()}
    cpus = {b: sorted(r["cpu"] for r in rs)[len(rs) // 2] for b, rs in runs.items()}
    compile_s = {b: ", ".join(f"{r['compile_seconds']:.1f}" for r in rs if "compile_seconds" in r)
                 for b, rs in runs.items()}
    rows = [[b, batches[b], f"{median[b]:.1f}", ", ".join(f"{w:.1f}" for w in walls[b]), f"{cpus[b]:.1f}",
             compile_s[b], f"{rs[0]['acc']:.4f}", f"{rs[0]['acc_norm']:.4f}"] for b, rs in runs.items()]  # fmt: skip
    print(f"\nthe backends alone (simple_evaluate, task index of the include path only), {rounds} rounds, "
          f"load average {os.getloadavg()[0]:.1f} at the end")
    print(harness.table(["backend", "batch", "process wall s (median)", "runs s", "process CPU s (median)",
                         "compile s (runs)", "acc", "acc_norm"], rows))
    same = all((r["acc"], r["acc_norm"]) == (runs["hf"][0]["acc"], runs["hf"][0]["acc_norm"])
               for b in ("otfload", "hf") for r in runs[b])
    floor = median["floor"]
    print(f"hf / otfload: {median['hf'] / median['otfload']:.2f}x; metrics equal: {same}; over the floor "
          f"(lm_eval's own {floor:.1f} s taken from both): {(median['hf'] - floor) / (median['otfload'] - floor):.2f}x")


def part_overlap(ckpt: Path, env: dict[str, str]) -> None:
    print(f"\nwidths {list(WIDTHS)}, batch {BATCH}, compilation cache off")
    rows = []
    for mode in ("sequential", "overlapped"):
        _, stdout = child([sys.executable, "-c", OVERLAP_CHILD, mode, ",".join(map(str, WIDTHS)), str(ckpt),
                           str(BATCH)], env)
        r = json.loads(stdout.strip().splitlines()[-1])
        longest = max(r["load_seconds"], r["compile_seconds"])
        rows.append([mode, f"{r['load_seconds']:.2f}", f"{r['compile_seconds']:.2f}", f"{longest:.2f}",
                     f"{r['ready']:.2f}", f"{r['ready'] / longest:.2f}"])  # fmt: skip
    print(harness.table(["mode", "load s", "compile s", "max(load, compile) s", "load + compile wall s", "wall / max"],
                        rows))  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--questions", type=int, default=1000)
    parser.add_argument("--parts", default="hf,backends,cache,overlap",
                        help="comma-separated: hf, backends, cache, overlap")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the backends part (default: 3)")
    parser.add_argument("--hf-batch", type=int, default=BATCH,
                        help=f"the hf backend's batch size in the backends part (default: {BATCH}, otfload's)")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny", help="the checkpoint (bench_eval's)")
    args = parser.parse_args(argv)
    ckpt = checkpoint(args.preset).resolve()
    tasks = make_task(ROOT / f"mc-{args.questions}", args.questions).resolve()
    # one CPU device, the machine as it is; datasets offline (the task's data are local files)
    env = {**{k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}, "JAX_PLATFORMS": "cpu",
           "HF_DATASETS_OFFLINE": "1", "TQDM_DISABLE": "1"}
    parts = args.parts.split(",")
    if "hf" in parts:
        part_hf(ckpt, tasks, env, args.questions)
    if "backends" in parts:
        part_backends(ckpt, tasks, env, args.rounds, args.hf_batch)
    if "cache" in parts:
        part_cache(ckpt, tasks, env)
    if "overlap" in parts:
        part_overlap(ckpt, env)


if __name__ == "__main__":
    main()
