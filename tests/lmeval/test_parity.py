"""The ``otfload`` lm_eval backend gives lm_eval's ``hf`` backend's numbers on the same checkpoint.

Tiny random checkpoints (dense, MoE, tied embeddings) with a real tokenizer, lm_eval's own task
files over local data (tests/lmeval/tasks.py), run through ``lm_eval.simple_evaluate`` once with
:class:`otfload.lm_eval.OtfloadLM` and once with lm_eval's ``HFLM`` (transformers on the CPU, float32):
every multiple-choice loglikelihood and rolling loglikelihood within 1e-4 relative, ``is_greedy``
and every greedy generation identical, and the reported metrics equal.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("lm_eval")

import tests.families.test_mixtral  # noqa: E402,F401  (registers the tiny Mixtral)
from tests.eval_support import with_tokenizer  # noqa: E402
from tests.lmeval.tasks import TASKS, tokenizer_config, write_tasks  # noqa: E402

REL = 1e-4


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    return write_tasks(tmp_path_factory.mktemp("lm_eval_tasks"))


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoints, tmp_path_factory):
    """``kind -> directory`` of the tiny checkpoint with tokenizer.json and tokenizer_config.json."""
    built = {}

    def get(kind: str):
        if kind not in built:
            path, _ = tiny_checkpoints(kind)
            built[kind] = with_tokenizer(path, tmp_path_factory.mktemp(f"{kind}-lm-eval"))
            tokenizer_config(built[kind])
        return built[kind]

    return get


def evaluate(model, task_dir, tasks, **options):
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    return lm_eval.simple_evaluate(model=model, tasks=list(tasks), task_manager=manager, log_samples=True, **options)


def close(a: float, b: float) -> bool:
    return abs(a - b) <= REL * abs(b)


def assert_same(ours, ref, tasks) -> None:
    for task in tasks:
        samples = list(zip(ours["samples"][task], ref["samples"][task], strict=True))
        for a, b in samples:
            assert a["doc_id"] == b["doc_id"]
            for x, y in zip(a["resps"], b["resps"], strict=True):
                if isinstance(y[0], str):  # a generation: identical text
                    assert x == y, (task, a["doc_id"], x, y)
                elif isinstance(y[0], tuple | list):  # (loglikelihood, is_greedy)
                    assert close(x[0][0], y[0][0]) and x[0][1] == y[0][1], (task, a["doc_id"], x, y)
                else:  # a rolling loglikelihood
                    assert close(x[0], y[0]), (task, a["doc_id"], x, y)
        mine, theirs = ours["results"][task], ref["results"][task]
        assert set(mine) == set(theirs)
        for key, value in theirs.items():
            if isinstance(value, float) and not math.isnan(value):
                assert math.isclose(mine[key], value, rel_tol=REL), (task, key, mine[key], value)
            else:
                assert mine[key] == value, (task, key)


@pytest.mark.parametrize(("kind", "mesh", "tasks"), [
    ("llama", "fsdp:2/tp:4", TASKS),
    ("mixtral", "fsdp:8", TASKS),
    ("llama_tied", "fsdp:4/tp:2", ("otf_mc", "otf_ppl")),
])
def test_same_numbers_as_hf_backend(checkpoint, task_dir, kind, mesh, tasks):
    from lm_eval.models.huggingface import HFLM

    from otfload.lm_eval import OtfloadLM

    path = checkpoint(kind)
    ours_model = OtfloadLM(str(path), mesh=mesh, batch_size=8)
    ours = evaluate(ours_model, task_dir, tasks)
    ref = evaluate(HFLM(pretrained=str(path), batch_size=8, device="cpu", dtype="float32"), task_dir, tasks)
    assert_same(ours, ref, tasks)
    generated = [s["resps"][0][0] for s in ours["samples"].get("otf_gen", [])]
    assert not generated or len(set(generated)) > 1  # the texts differ: the comparison is not vacuous
    timings = ours_model.timings
    assert timings.load_seconds > 0 and timings.compile_seconds > 0 and timings.score_seconds > 0


def test_by_name_with_model_args_and_no_abstract_model(checkpoint, task_dir):
    """``model="otfload"`` with lm_eval's ``model_args`` string (mesh, dtype, quantized, batch size)
    scores as the Python constructor does; ``quantized="keep"`` compiles after the load (no
    abstract model to compile against) and changes no number of an unquantized checkpoint."""
    from otfload.lm_eval import OtfloadLM

    path = checkpoint("llama")
    tasks = ("otf_mc",)
    by_name = evaluate("otfload", task_dir, tasks, model_args=f"pretrained={path},mesh=fsdp:4/tp:2,dtype=float32,"
                       "quantized=keep,batch_size=4")
    direct = OtfloadLM(str(path), mesh="fsdp:8", batch_size=8)
    assert direct.scorer.abstract is not None
    assert_same(by_name, evaluate(direct, task_dir, tasks), tasks)
