"""The ``otfload`` lm_eval backend gives lm_eval's ``hf`` backend's numbers on the same checkpoint.

Tiny random checkpoints (dense, MoE, tied embeddings) with a real tokenizer, lm_eval's own task
files over local data (tests/lmeval/tasks.py), run through ``lm_eval.simple_evaluate`` once with
:class:`otfload.lm_eval.OtfloadLM` and once with lm_eval's ``HFLM`` (transformers on the CPU, float32):
every multiple-choice loglikelihood and rolling loglikelihood within 1e-4 relative, ``is_greedy``
and every greedy generation identical, and the reported metrics equal. The choices of a question
share its context, which otfload scores once (packed rows): a short ``max_length`` checks the
packs next to requests cut to it, on an MoE and a sliding-window model.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("lm_eval")

import tests.families.test_mixtral  # noqa: E402,F401  (registers the tiny Mixtral)
from tests.eval_support import with_tokenizer  # noqa: E402
from tests.families.test_gemma import _gemma3  # noqa: E402
from tests.helpers import register_hf_model  # noqa: E402
from tests.lmeval.tasks import TASKS, tokenizer_config, write_tasks  # noqa: E402

REL = 1e-4
# Gemma 3 (sliding and full layers) with a window shorter than the grouped test's max_length, so
# that some packs are bounded by the window and some requests longer than it are scored alone.
register_hf_model("gemma3_window8", _gemma3, {"sliding_window": 8})
GROUPED_MAX_LENGTH = 16


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


@pytest.fixture(scope="module")
def hf_reference(checkpoint, task_dir):
    """``(kind, tasks) -> lm_eval's hf backend's evaluation`` (batch 8, float32), each evaluated once."""
    from lm_eval.models.huggingface import HFLM

    done = {}

    def get(kind: str, tasks: tuple[str, ...]):
        if (kind, tasks) not in done:
            model = HFLM(pretrained=str(checkpoint(kind)), batch_size=8, device="cpu", dtype="float32")
            done[kind, tasks] = evaluate(model, task_dir, tasks)
        return done[kind, tasks]

    return get


@pytest.mark.parametrize(("kind", "mesh", "tasks"), [
    ("llama", "fsdp:2/tp:4", TASKS),
    ("mixtral", "fsdp:8", TASKS),
    ("llama_tied", "fsdp:4/tp:2", ("otf_mc", "otf_ppl")),
])
def test_same_numbers_as_hf_backend(checkpoint, task_dir, hf_reference, kind, mesh, tasks):
    from otfload.lm_eval import OtfloadLM

    ours_model = OtfloadLM(str(checkpoint(kind)), mesh=mesh, batch_size=8)
    ours = evaluate(ours_model, task_dir, tasks)
    assert_same(ours, hf_reference(kind, tasks), tasks)
    generated = [s["resps"][0][0] for s in ours["samples"].get("otf_gen", [])]
    assert not generated or len(set(generated)) > 1  # the texts differ: the comparison is not vacuous
    timings = ours_model.timings
    assert timings.load_seconds > 0 and timings.compile_seconds > 0 and timings.score_seconds > 0


def test_by_name_with_model_args_and_no_abstract_model(checkpoint, task_dir, hf_reference):
    """``model="otfload"`` with lm_eval's ``model_args`` string (mesh, dtype, quantized, batch size)
    gives the hf backend's numbers, as the Python constructor does (test_same_numbers_as_hf_backend);
    ``quantized="keep"`` compiles after the load (no abstract model to compile against, where the
    constructor's default has one) and changes no number of an unquantized checkpoint."""
    from otfload.lm_eval import OtfloadLM

    path = checkpoint("llama")
    tasks = ("otf_mc",)
    by_name = evaluate("otfload", task_dir, tasks, model_args=f"pretrained={path},mesh=fsdp:4/tp:2,dtype=float32,"
                       "quantized=keep,batch_size=4,compile_cache=off")  # (on by default: test_cli's jobs)
    assert_same(by_name, hf_reference("llama", TASKS), tasks)  # the reference's otf_mc: the same documents
    direct = OtfloadLM(str(path), mesh="fsdp:8", batch_size=8)
    assert direct.scorer.abstract is not None
    direct.close()


# No plain llama here: mixtral packs without a window as llama does (the same attention; only its MLP is
# MoE), and gemma3_window8 is the dense model with a window.
@pytest.mark.parametrize("kind", ["mixtral", "gemma3_window8"])
def test_shared_contexts_packed_next_to_cut_requests(checkpoint, task_dir, kind):
    """With ``max_length`` 16, questions whose context and choice fit are packed (all choices of a
    question after its context, within the model's sliding window), longer ones are cut to 16 ids
    and scored alone, as lm_eval's rule cuts them: the same numbers as the hf backend."""
    from lm_eval.models.huggingface import HFLM

    from otfload.lm_eval import OtfloadLM
    from otfload.lm_eval.scoring import make_groups

    class Recording(OtfloadLM):
        def _loglikelihood_tokens(self, requests, disable_tqdm=False, **kwargs):
            self.requests = [(context, continuation) for _, context, continuation in requests]
            return super()._loglikelihood_tokens(requests, disable_tqdm, **kwargs)

    path = checkpoint(kind)
    ours_model = Recording(str(path), mesh="fsdp:8", batch_size=4, max_length=GROUPED_MAX_LENGTH)
    ours = evaluate(ours_model, task_dir, ("otf_mc",))
    ref = evaluate(HFLM(pretrained=str(path), batch_size=4, device="cpu", dtype="float32",
                        max_length=GROUPED_MAX_LENGTH), task_dir, ("otf_mc",))
    assert_same(ours, ref, ("otf_mc",))
    groups = make_groups(ours_model.requests, GROUPED_MAX_LENGTH, ours_model._load.sliding_window)
    cut = [g for g in groups if len(g.requests) == 1 and
           sum(map(len, ours_model.requests[g.requests[0]])) > GROUPED_MAX_LENGTH + 1]
    assert max(len(g.requests) for g in groups) == (3 if kind == "gemma3_window8" else 4) and cut  # packs, cut requests
    if kind == "gemma3_window8":
        assert ours_model._load.sliding_window == 8 and max(len(g.ids) for g in groups if len(g.requests) > 1) <= 8
        assert any(len(g.ids) > 8 for g in groups)  # requests longer than the window, scored alone
