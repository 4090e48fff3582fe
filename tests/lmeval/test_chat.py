"""Chat templates (lm_eval's ``apply_chat_template``): the checkpoint's template found where
transformers finds it and rendered as transformers renders it (against ``AutoTokenizer`` on the same
files), and a chat-templated lm_eval job scored as lm_eval's ``hf`` backend scores it."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lm_eval")

from otfload.errors import TokenizerError  # noqa: E402
from otfload.lm_eval.chat import render_chat, select_template  # noqa: E402
from otfload.sources.owned import owned_source  # noqa: E402
from tests.eval_support import build_tokenizer, with_tokenizer  # noqa: E402
from tests.lmeval.tasks import tokenizer_config, write_tasks  # noqa: E402
from tests.lmeval.test_parity import assert_same, evaluate  # noqa: E402

# Refuses a system turn (lm_eval's hf backend then drops it), trims contents (a continued final
# message loses its trailing space), BOS and EOS written by the template.
STRICT = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
          "{{ raise_exception('no system role') }}{% endif %}{{ m['role'] }}: {{ m['content'] | trim }}"
          "{% if not loop.last %}{{ eos_token }}\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}{{ eos_token }}\nassistant:{% endif %}")
# Keeps the contents' spacing, a system turn, tojson (no HTML escaping), loop controls.
LOOSE = ("{% for m in messages %}{% if m['role'] == 'tool' %}{% continue %}{% endif %}"
         "<|{{ m['role'] }}|>{{ m['content'] }}{{ '' if loop.last else '\n' }}{% endfor %}"
         "{% if add_generation_prompt %}<|assistant|>{{ {'a': '<&>'} | tojson }}{% endif %}")
CHATS = [
    [{"role": "user", "content": "the quick fox"}],
    [{"role": "user", "content": "what jumps "}, {"role": "assistant", "content": "the fox "},
     {"role": "user", "content": "and then?"}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a partial answer "}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
]


def tokenizer_dir(tmp_path, config, files=None):
    build_tokenizer(tmp_path / "tokenizer.json")
    base = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    for name, text in (files or {}).items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    return tmp_path


def ours(root):
    from otfload.lm_eval.tokens import checkpoint_tokenizer

    with owned_source(root) as source:
        return checkpoint_tokenizer(source, {})


@pytest.mark.parametrize("template", [STRICT, LOOSE])
@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_rendered_as_transformers_renders_it(tmp_path, template, chat, generation_prompt):
    from transformers import AutoTokenizer

    root = tokenizer_dir(tmp_path, {"chat_template": template})
    tokenizer = ours(root)
    theirs = AutoTokenizer.from_pretrained(str(root))
    assert tokenizer.chat_template == theirs.chat_template
    mine = render_chat(select_template(tokenizer.chat_template), chat, tokenizer.special_tokens_map, generation_prompt)
    options = dict(tokenize=False, add_generation_prompt=generation_prompt,
                   continue_final_message=not generation_prompt)
    try:
        expected = theirs.apply_chat_template(chat, **options)
    except Exception:  # the template refused the system turn: lm_eval's hf backend renders the chat without it
        expected = theirs.apply_chat_template([m for m in chat if m["role"] != "system"], **options)
    assert mine == expected
    assert "CONTINUE" not in mine


def test_templates_found_where_transformers_finds_them(tmp_path):
    from transformers import AutoTokenizer

    named = [{"name": "default", "template": LOOSE}, {"name": "rag", "template": STRICT}]
    cases = {
        "named in the config": ({"chat_template": named}, {}),
        "a .jinja file over the config's": ({"chat_template": STRICT}, {"chat_template.jinja": LOOSE}),
        "a file and named files": ({}, {"chat_template.jinja": LOOSE, "additional_chat_templates/rag.jinja": STRICT}),
        "none": ({}, {}),
    }
    for i, (config, files) in enumerate(cases.values()):
        root = tokenizer_dir(tmp_path / str(i), config, files)
        assert ours(root).chat_template == AutoTokenizer.from_pretrained(str(root)).chat_template, list(cases)[i]
    assert select_template({"default": LOOSE, "rag": STRICT}) == LOOSE
    assert select_template({"default": LOOSE, "rag": STRICT}, "rag") == STRICT
    with pytest.raises(TokenizerError, match="no chat template"):
        select_template(None)
    with pytest.raises(TokenizerError, match="no chat template named 'default'"):
        select_template({"rag": STRICT})


def test_a_template_that_drops_the_final_message_cannot_continue_it(tmp_path):
    with pytest.raises(TokenizerError, match="drops part of the final message"):
        render_chat("{% for m in messages %}{{ m['role'] }}{% endfor %}", CHATS[0], {}, add_generation_prompt=False)


@pytest.fixture(scope="module")
def chat_checkpoint(tiny_checkpoints, tmp_path_factory):
    path, _ = tiny_checkpoints("llama")
    root = with_tokenizer(path, tmp_path_factory.mktemp("llama-chat"))
    tokenizer_config(root)
    config = json.loads((root / "tokenizer_config.json").read_text())
    (root / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": STRICT}))
    return root


def test_chat_templated_job_equals_hf_backend(chat_checkpoint, tmp_path):
    """Few-shot turns as messages, a system instruction the template refuses (dropped by both), the
    template's BOS not doubled: loglikelihoods within 1e-4, generations and metrics equal."""
    from lm_eval.models.huggingface import HFLM

    from otfload.lm_eval import OtfloadLM

    tasks = ("otf_mc", "otf_gen")
    task_dir = write_tasks(tmp_path / "tasks", questions=8)
    options = dict(apply_chat_template=True, fewshot_as_multiturn=True, num_fewshot=2, system_instruction="be brief")
    model = OtfloadLM(str(chat_checkpoint), mesh="fsdp:4/tp:2", batch_size=8)
    mine = evaluate(model, task_dir, tasks, **options)
    ref = evaluate(HFLM(pretrained=str(chat_checkpoint), batch_size=8, device="cpu", dtype="float32"), task_dir, tasks,
                   **options)
    assert_same(mine, ref, tasks)
    prompt = mine["samples"]["otf_mc"][0]["arguments"][0][0]  # the few-shot turns and the question, templated
    assert prompt.startswith("<s>user: ") and prompt.count("assistant: ") == 2 and "be brief" not in prompt
