"""``otfload lm-eval``: run lm-evaluation-harness tasks on a checkpoint, scored by otfload.

One command for an lm_eval job: the checkpoint (any source) is loaded by otfload while lm_eval
builds the tasks' requests and the scoring shapes compile, and the tasks are run by lm_eval
itself (its task files, few-shot samplers, filters and metrics), so the numbers are lm_eval's.
--tasks takes lm_eval task or group names, comma-separated; --include-path adds a directory of
task YAML files. Compiled executables are kept for the next job (--compile-cache). Prints
lm_eval's table and the time spent loading, compiling, scoring and generating; --json prints one
object instead: {"source", "tasks", "results" (lm_eval's task -> "metric,filter" -> value),
"timings"}. Needs the lm-eval extra (pip install "otfload[lm-eval]").
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Any

from otfload.cli import options
from otfload.cli.compile_cache import add_compile_cache_arg, enable_compile_cache
from otfload.errors import InvalidOptionError


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("lm-eval", help="run lm-evaluation-harness tasks, scored by otfload",
                            description=options.description(__doc__), parents=[options.common_parser()])
    options.add_source_args(p)
    options.add_layout_args(p)
    options.add_adapter_args(p)
    p.add_argument("--tasks", required=True, metavar="T[,T...]", help="lm_eval task or group names")
    p.add_argument("--include-path", metavar="DIR", help="a directory of lm_eval task YAML files to add")
    p.add_argument("--limit", type=float, metavar="N",
                   help="at most N documents per task (a fraction of each task when below 1)")
    p.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--batch-size", type=options.positive_int, default=16, metavar="B",
                   help="rows per forward pass (default: 16)")
    p.add_argument("--max-length", type=options.positive_int, metavar="L",
                   help="context window in tokens (default: the config's max_position_embeddings)")
    p.add_argument("--quantized", choices=("dequantize", "keep"), default="dequantize",
                   help="quantized weights decoded on load (default) or kept packed")
    p.add_argument("--seed", type=int, default=1234, help="lm_eval's seed for few-shot sampling (default: 1234)")
    add_compile_cache_arg(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr: the load's too (--progress), none (--no-progress); default: "
                        "the requests' bars")
    p.add_argument("--json", action="store_true", help="print one JSON object with lm_eval's results")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    enable_compile_cache(args.compile_cache)
    import lm_eval
    from lm_eval.tasks import TaskManager
    from lm_eval.utils import make_table

    from otfload.lm_eval import OtfloadLM

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    manager = TaskManager(include_path=args.include_path)
    unknown = [t for t in tasks if not manager.match_tasks([t]) and not os.path.exists(t)]
    if unknown:  # before the load, not after it
        raise InvalidOptionError(f"--tasks: no lm_eval task or group named {', '.join(unknown)} "
                                 f"({len(manager.all_tasks)} known; --include-path adds a directory of task files)")
    layout = options.layout_kwargs(args)
    model = OtfloadLM(args.source, batch_size=args.batch_size, max_length=args.max_length, progress=args.progress,
                      quantized=args.quantized, **layout, **options.adapter_kwargs(args),
                      **options.source_options(args))
    out = lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                                  task_manager=manager, random_seed=args.seed, numpy_random_seed=args.seed,
                                  torch_random_seed=args.seed, fewshot_random_seed=args.seed)
    timings = model.timings.to_dict()
    if args.json:
        results = _plain(out["results"])
        print(json.dumps({"source": args.source, "tasks": tasks, "results": results, "timings": timings}))
    else:
        print(make_table(out))
        print("load {load_seconds:.2f} s (compiling {compile_seconds:.2f} s alongside); scoring {score_seconds:.2f} s; "
              "generating {generate_seconds:.2f} s".format(**timings))
    return 0


def _plain(value: Any) -> Any:
    """lm_eval's results as JSON: numpy numbers as Python ones, NaN as null."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # a numpy scalar
        value = value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    return value
