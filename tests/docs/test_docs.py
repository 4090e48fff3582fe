"""The user guides I own: every code block runs, offline, and the reference pages stay complete.

Convention for code blocks: all ```python blocks of one page run in order as one script, and its
```bash blocks then run in one bash shell with the ``otfload`` script on PATH. A block that needs a
checkpoint reads its location from the environment variable ``OTFLOAD_EXAMPLE_CKPT`` (here a tiny
local float32 Llama in several shard files, from the ``tiny_checkpoints`` fixture, with a tiny
``tokenizer.json``; for a reader, a Hub id fallback), and one that needs a PEFT LoRA adapter of it
from ``OTFLOAD_EXAMPLE_ADAPTER`` (one PEFT saved here, naming the Llama as its base). ```text blocks
are sample output and are not run.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import otfload.errors
from otfload.families.registry import supported_model_types
from tests.adapters.support import make_adapter
from tests.eval_support import with_tokenizer

DOCS = Path(__file__).resolve().parents[2] / "docs"
PAGES = ["index.md", "quickstart.md", "concepts.md", "families.md", "adding_a_family.md", "troubleshooting.md",
         "sources.md", "export.md", "byo_model.md", "adapters.md", "evaluation.md"]

RUNNER = r"""
import contextlib, re, subprocess, sys, traceback
for page in sys.argv[1:]:
    text = open(page).read()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the verdicts
            code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
            exec(compile(code, page, "exec"), {"__name__": "doc"})
        for block in re.findall(r"```bash\n(.*?)```", text, re.S):
            subprocess.run(["bash", "-euo", "pipefail", "-c", block], check=True, stdout=sys.stderr)
    except BaseException:
        print(f"FAILED {page}", flush=True)
        traceback.print_exc()
        continue
    print(f"ok {page}", flush=True)
"""


def test_every_code_block_runs(tiny_checkpoints, tmp_path):
    llama, torch_model = tiny_checkpoints("llama")
    checkpoint = with_tokenizer(llama, tmp_path / "tiny-llama")
    adapter = make_adapter(torch_model, tmp_path / "tiny-lora", r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                           base_model_name_or_path=str(checkpoint))
    env = {**os.environ, "OTFLOAD_EXAMPLE_CKPT": str(checkpoint), "OTFLOAD_EXAMPLE_ADAPTER": str(adapter),
           "TQDM_DISABLE": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run([sys.executable, "-c", RUNNER, *(str(DOCS / p) for p in PAGES)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.stdout.split() == [w for p in PAGES for w in ("ok", str(DOCS / p))], out.stdout + out.stderr
    assert all(re.search(r"```(python|bash|text)\n", (DOCS / p).read_text()) for p in PAGES)


def test_families_table_is_the_registry():
    table = re.findall(r"^\| `(\w+)` \|", (DOCS / "families.md").read_text(), re.M)
    assert sorted(table) == supported_model_types()


def test_troubleshooting_covers_every_typed_error():
    errors = {name for name, obj in vars(otfload.errors).items()
              if isinstance(obj, type) and issubclass(obj, otfload.errors.OtfloadError)}
    headings = set(re.findall(r"^### (\w+)$", (DOCS / "troubleshooting.md").read_text(), re.M))
    assert headings == errors


def test_links_between_pages_resolve():
    index_links = set(re.findall(r"\]\(([\w.]+\.md)", (DOCS / "index.md").read_text()))
    others = {"checkpoints.md", "export.md", "sources.md", "benchmarks.md", "reliability.md"}
    assert index_links >= {p for p in PAGES if p != "index.md"} | others
    for page in PAGES:
        for link in re.findall(r"\]\(([\w.]+\.md)", (DOCS / page).read_text()):
            assert (DOCS / link).exists(), (page, link)
