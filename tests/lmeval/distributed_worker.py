"""One process of a multi-process lm_eval job (tests/lmeval/test_distributed.py).

    python -m tests.lmeval.distributed_worker SPEC_JSON PROCESS_ID

``SPEC_JSON`` (a file) says: ``processes``, ``local_devices``, ``port`` (the coordinator's),
``checkpoint``, ``meshes`` (OtfloadLM's, one evaluation each, in order: one job start-up for all),
``task_dir``, ``tasks``, ``batch_size`` and ``out`` (a directory). The process joins the job, runs
``lm_eval.simple_evaluate`` with the ``otfload`` backend on each mesh and writes ``proc<i>.json``:
a list with, per mesh, its rank and world size, the requests it answered, and what
``simple_evaluate`` returned to it (results and every logged sample's responses by task and
document, or null).
"""

from __future__ import annotations

import json
import sys
import traceback
from pathlib import Path


def counting(method, answered: list[int]):
    """``method`` (a request type's), noting how many requests each call answers in ``answered``."""
    def counted(requests, *args, **kwargs):
        answered.append(len(requests))
        return method(requests, *args, **kwargs)
    return counted


def evaluate(spec: dict, mesh: str) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    from otfload.lm_eval import OtfloadLM

    model = OtfloadLM(spec["checkpoint"], mesh=mesh, batch_size=spec["batch_size"])
    answered: list[int] = []
    for method in ("loglikelihood", "loglikelihood_rolling", "generate_until"):
        setattr(model, method, counting(getattr(model, method), answered))
    out = lm_eval.simple_evaluate(model=model, tasks=spec["tasks"], log_samples=True,
                                  task_manager=TaskManager(include_path=spec["task_dir"], include_defaults=False))
    report = {"rank": model.rank, "world_size": model.world_size, "answered": sum(answered), "out": None}
    if out is not None:
        report["out"] = {
            "results": out["results"],
            "samples": {task: {str(s["doc_id"]): s["resps"] for s in rows} for task, rows in out["samples"].items()},
        }
    return report


def main() -> None:
    spec = json.loads(Path(sys.argv[1]).read_text())
    pid = int(sys.argv[2])
    out = Path(spec["out"])

    import jax

    from tests.multihost.launch import join_cpu_job

    join_cpu_job(spec, pid)  # a job of several processes: the test starts two
    try:
        report = [evaluate(spec, mesh) for mesh in spec["meshes"]]
        (out / f"proc{pid}.json").write_text(json.dumps(report, default=lambda v: v.item()))
    except BaseException:
        (out / f"proc{pid}.error").write_text(traceback.format_exc())
        raise
    finally:
        jax.distributed.shutdown()


if __name__ == "__main__":
    main()
