"""``otfload lm-eval``: run lm-evaluation-harness tasks on a checkpoint, scored by otfload.

One command for an lm_eval job: the checkpoint (any source) is loaded by otfload while lm_eval
builds the tasks' requests and the scoring shapes compile, and the tasks are run by lm_eval
itself (its task files, few-shot samplers, filters and metrics), so the numbers are lm_eval's.
--tasks takes lm_eval task or group names, comma-separated; --include-path adds a directory of
task YAML files. Compiled executables are kept for the next job (--compile-cache). Prints
lm_eval's table and the time spent loading, compiling, scoring and generating; --json prints one
object instead: {"source", "tasks", "results" (lm_eval's task -> "metric,filter" -> value),
"timings"}. --apply-chat-template renders prompts with the checkpoint's chat template (few-shot
examples as turns). A job can run as several processes (one per host, each started with
--coordinator, --num-processes and --process-id): on a --mesh of each process's devices each scores
a share of the documents; on one over every process's devices they run every batch together,
sharded over the mesh; the first process alone prints. Needs the lm-eval extra
(from a clone of the source: pip install -e ".[lm-eval]").
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

from otfload.cli import options
from otfload.cli.compile_cache import add_compile_cache_arg
from otfload.errors import InvalidOptionError, TokenizerError


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = commands.add_parser("lm-eval", help="run lm-evaluation-harness tasks, scored by otfload",
                            description=options.description(__doc__), parents=[options.common_parser()])
    options.add_source_args(p)
    options.add_layout_args(p, mesh_help="mesh axes over this process's devices, e.g. fsdp=4,tp=2 (in a job of "
                            "several processes, over all of theirs when the sizes multiply to their count)")
    options.add_load_args(p)
    p.add_argument("--tasks", required=True, metavar="T[,T...]", help="lm_eval task or group names")
    p.add_argument("--include-path", metavar="DIR", help="a directory of lm_eval task YAML files to add")
    p.add_argument("--limit", type=float, metavar="N",
                   help="at most N documents per task (a fraction of each task when below 1)")
    p.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--batch-size", type=options.positive_int, default=16, metavar="B",
                   help="rows per forward pass (default: 16)")
    p.add_argument("--max-length", type=options.positive_int, metavar="L",
                   help="context window in tokens (default: the config's max_position_embeddings)")
    p.add_argument("--apply-chat-template", action="store_true",
                   help="render each prompt with the checkpoint's chat template (few-shot turns as messages)")
    p.add_argument("--seed", type=int, default=1234, help="lm_eval's seed for few-shot sampling (default: 1234)")
    add_compile_cache_arg(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="progress bars on stderr: the load's too (--progress), none (--no-progress); default: "
                        "the requests' bars")
    p.add_argument("--json", action="store_true", help="print one JSON object with lm_eval's results")
    dist = p.add_argument_group("several processes (jax.distributed), one command per process")
    dist.add_argument("--coordinator", metavar="HOST:PORT", help="the address of process 0's coordination service")
    dist.add_argument("--num-processes", type=options.positive_int, metavar="N", help="processes in the job")
    dist.add_argument("--process-id", type=int, metavar="I", help="this process's index, 0 to N-1")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from otfload.cli.task_names import unmentioned

    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise InvalidOptionError(f"--include-path {args.include_path!r}: no such directory of lm_eval task files")
    missing, defined = unmentioned(tasks, args.include_path)  # before lm_eval's own index (~20 s)
    check_tasks(tasks, defined, lambda t: t not in missing)
    from otfload.lm_eval.ranks import join_job  # imports lm_eval (~3 s)

    flags = ("--coordinator", "--num-processes", "--process-id")
    join_job(args.coordinator, args.num_processes, args.process_id, flags)
    from otfload.compile_cache import enable_compile_cache

    enable_compile_cache(args.compile_cache)
    import jax
    import lm_eval
    from lm_eval.utils import make_table

    from otfload.lm_eval import OtfloadLM

    manager = _task_manager(tasks, args.include_path)
    check_tasks(tasks, manager.all_tasks, lambda t: bool(manager.match_tasks([t])) or os.path.exists(t))
    options.adapter_as_checkpoint(args)
    # OtfloadLM resolves --mesh: over this process's devices (each process scores a share of the
    # documents), or over every process's when its sizes multiply to their count (one replica)
    model = OtfloadLM(args.source, mesh=args.mesh, options=options.load_options(args, mesh=False),
                      batch_size=args.batch_size, max_length=args.max_length, progress=args.progress)
    with _stdout_to_stderr() if args.json else contextlib.nullcontext(), _leaving_on_error(model):
        if model.tokenizer.eos_id is None:  # the checkpoint's fault, found before lm_eval starts on the tasks
            raise TokenizerError(f"{args.source}: the checkpoint's tokenizer names no EOS token (tokenizer_config.json "
                                 "eos_token or config.json eos_token_id): lm_eval needs one")
        out = lm_eval.simple_evaluate(model=model, tasks=tasks, num_fewshot=args.num_fewshot, limit=args.limit,
                                      task_manager=manager, apply_chat_template=args.apply_chat_template,
                                      random_seed=args.seed, numpy_random_seed=args.seed,
                                      torch_random_seed=args.seed, fewshot_random_seed=args.seed)
    if out is None or jax.process_index() != 0:  # in a jax.distributed job, process 0 alone prints the results
        return 0
    timings = model.timings.to_dict()
    if args.json:
        results = _plain(out["results"])
        print(json.dumps({"source": args.source, "tasks": tasks, "results": results, "timings": timings}))
    else:
        print(make_table(out))
        print("load {load_seconds:.2f} s; compiling {compile_seconds:.2f} s (scoring shapes while the weights load); "
              "scoring {score_seconds:.2f} s; generating {generate_seconds:.2f} s".format(**timings))
    return 0


def check_tasks(tasks: list[str], known: list[str], found: Callable[[str], bool]) -> None:
    """Raise :class:`InvalidOptionError` for the names in ``tasks`` that ``found`` refuses, each with
    the closest of ``known`` (did you mean ...?), before anything is loaded."""
    unknown = [t for t in tasks if not found(t)]
    if not unknown:
        return
    hints = [f"{t!r} (did you mean {', '.join(map(repr, close))}?)" if (close := difflib.get_close_matches(t, known, 3))
             else repr(t) for t in unknown]
    raise InvalidOptionError(f"--tasks: no lm_eval task or group named {', '.join(hints)} "
                             f"({len(known)} known; --include-path adds a directory of task files)")


def _task_manager(tasks: list[str], include_path: str | None) -> Any:
    """lm_eval's task index: of ``include_path`` alone when every task named is a task file there, else
    with lm_eval's built-in tasks too (indexing those reads ~14k YAML files: about 16 s of a job)."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._index import Kind

    if include_path:
        local = TaskManager(include_path=include_path, include_defaults=False)
        index = local.task_index
        if all(os.path.exists(t) or (t in index and index[t].kind in (Kind.TASK, Kind.PY_TASK)) for t in tasks):
            return local
    return TaskManager(include_path=include_path)


@contextlib.contextmanager
def _stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 pointed at stderr for the job, so that --json's stdout holds the JSON object
    only: native libraries print there too (Gloo, which XLA's CPU collectives use in a multi-process
    job, prints a line per connection)."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


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


@contextlib.contextmanager
def _leaving_on_error(model: Any) -> Iterator[None]:
    """The job's error told to the other processes (:meth:`otfload.lm_eval.ranks.Ranks.leave`), so
    that they end with it instead of waiting for this process at lm_eval's next exchange; the
    model's load stopped and its source closed."""
    try:
        yield
    except BaseException as err:
        model.ranks.leave(f"{type(err).__name__}: {err}")
        model.close()  # a load still running stops; its files are closed
        raise
