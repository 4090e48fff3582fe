"""Local lm_eval tasks for the parity tests: YAML task files over JSONL data written to a directory.

Three tasks, one per request type, in lm_eval's own task format (nothing is fetched: the data
are ``json`` datasets of local files): ``otf_mc`` (multiple choice, ``loglikelihood``: acc and
acc_norm), ``otf_ppl`` (``loglikelihood_rolling``: word/byte perplexity, bits per byte) and
``otf_gen`` (``generate_until`` with stop strings and a token budget: exact match). The texts use
the tiny tokenizer's words (tests/eval_support.py) and some it has never seen.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.eval_support import CORPUS, TEXTS

TASKS = ("otf_mc", "otf_ppl", "otf_gen")
WORDS = " ".join(CORPUS).split()
# Stop strings of the generation task: common tokens of the tiny vocabulary, so that greedy
# continuations of a random model do hit them (and some rows run to the token budget).
GEN_STOPS = [" the", "s"]
GEN_TOKENS = 10


def tokenizer_config(path: Path) -> None:
    """``tokenizer_config.json`` naming the tiny tokenizer's special tokens, as transformers writes it."""
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "clean_up_tokenization_spaces": False}
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _phrase(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def write_tasks(root: Path, questions: int = 12, seed: int = 0) -> Path:
    """Write the three tasks (``questions`` multiple-choice questions) under ``root``; returns it
    (lm_eval's ``include_path``)."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    mc = [{"question": _phrase(rng, rng.randint(1, 12)) + (" " if i % 3 == 0 else ""),
           "choices": [_phrase(rng, rng.randint(1, 4)) for _ in range(4)], "answer": rng.randrange(4)}
          for i in range(questions)]
    ppl = [{"text": t} for t in [*TEXTS[:1], *TEXTS[2:6], " ".join(CORPUS * 4)]]  # the last spans several windows
    gen = [{"question": _phrase(rng, rng.randint(2, 9)), "answer": _phrase(rng, 1)} for _ in range(6)]
    for name, rows in (("mc", mc), ("ppl", ppl), ("gen", gen)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = "dataset_path: json\ntest_split: test\n"
    (root / "otf_mc.yaml").write_text(
        f"task: otf_mc\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'mc.jsonl'}\n"
        "output_type: multiple_choice\ndoc_to_text: \"{{question}}\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: \"{{answer}}\"\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (root / "otf_ppl.yaml").write_text(
        f"task: otf_ppl\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'ppl.jsonl'}\n"
        "output_type: loglikelihood_rolling\ndoc_to_text: \"\"\ndoc_to_target: \"{{text}}\"\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: byte_perplexity\n  - metric: bits_per_byte\n")
    (root / "otf_gen.yaml").write_text(
        f"task: otf_gen\n{common}dataset_kwargs:\n  data_files:\n    test: {root / 'gen.jsonl'}\n"
        "output_type: generate_until\ndoc_to_text: \"{{question}}\"\ndoc_to_target: \"{{answer}}\"\n"
        f"generation_kwargs:\n  until: {json.dumps(GEN_STOPS)}\n  max_gen_toks: {GEN_TOKENS}\n  do_sample: false\n"
        "metric_list:\n  - metric: exact_match\n")
    return root
