"""Every code block in README.md and docs/ runs as written, offline, and the reference pages stay complete.

Convention for code blocks (checked here for every page in ``PAGES`` and README.md):

- Every fence names its language, one of ``FENCES``: a block without one would be silently skipped.
- All ```python blocks of one page run in order as one script (every page in one interpreter, each
  with fresh globals, in a scratch working directory); the page's ```bash blocks then run in one
  bash shell each (``-euo pipefail``) with ``otfload`` on PATH: the bash is real, and its ``otfload``
  commands run as ``otfload.cli.main(argv)`` in that same interpreter, with the command's descriptors,
  environment and directory (``tests/docs/cli_worker.py``, checked against the console script in
  ``test_cli_worker.py``), not one fresh interpreter each; a ``--coordinator`` job's processes, and
  ``otfload example`` here, are the real console script.
- A block that needs a checkpoint reads its location from the environment variable
  ``OTFLOAD_EXAMPLE_CKPT`` (for a reader, a Hub id fallback), one that needs a PEFT LoRA adapter of
  it from ``OTFLOAD_EXAMPLE_ADAPTER``, and one that needs a quantized checkpoint from
  ``OTFLOAD_EXAMPLE_QUANTIZED``. Here, as for a newcomer, they come from the example-checkpoint
  command alone (``otfload example DIR``, whose export lines set them: a tiny float32 Llama in
  several shard files with its tokenizer and chat template, a LoRA adapter naming it as its base,
  that Llama with every linear layer in compressed-tensors FP8).
- Shell commands run in a bash block only when they are fast on that tiny checkpoint (``otfload
  inspect``, ``load``, ``eval``, ...). Sample output goes in ```text blocks, and commands that are not
  run here (long measurements, commands that need the network or a real model) in ```console
  blocks; neither is run.
- README.md: its python blocks run here; its first two bash blocks (install and the test suite,
  then ``examples/quickstart.py``) are CI's own commands, run by ``.ci/run`` on a fresh machine, so
  they are not run here.
- Exempt (``EXEMPT``): the benchmark pages, whose bash blocks are the long measurements that
  reproduce their tables (minutes to hours on real checkpoints). Every other page in docs/ is in
  ``PAGES`` (so a new page cannot go unrun unnoticed).
"""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import otfload.errors
from otfload.families.registry import supported_model_types
from tests import forked

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
PAGES = ["index.md", "quickstart.md", "concepts.md", "architecture.md", "families.md", "adding_a_family.md",
         "troubleshooting.md", "sources.md", "export.md", "byo_model.md", "adapters.md", "evaluation.md",
         "checkpoints.md", "reliability.md", "robustness.md", "training.md", "formats.md", "maxtext.md"]
EXEMPT = {"benchmarks.md", "benchmarks_log.md", "benchmarks_export.md", "benchmarks_remote.md", "benchmarks_reshard.md"}
FENCES = {"python", "bash", "text", "console"}

WORKER = Path(__file__).with_name("cli_worker.py")
RUNNER = r"""
import contextlib, importlib.util, re, sys, traceback
spec = importlib.util.spec_from_file_location("cli_worker", sys.argv[1])  # by path: sys.path stays a reader's
cli_worker = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cli_worker)
readme = sys.argv[2]
with cli_worker.Worker() as worker:
    for page in sys.argv[3:]:
        text = open(page).read()
        try:
            with contextlib.redirect_stdout(sys.stderr):  # stdout carries only the verdicts
                code = "\n".join(re.findall(r"```python\n(.*?)```", text, re.S))
                exec(compile(code, page, "exec"), {"__name__": "doc"})
            for block in re.findall(r"```bash\n(.*?)```", text, re.S) if page != readme else []:
                worker.run_bash(block, stdout=sys.stderr)
        except BaseException:
            print(f"FAILED {page}", flush=True)
            traceback.print_exc()
            continue
        print(f"ok {page}", flush=True)
"""


def fence_languages(text: str) -> list[str]:
    """The language named by each opening fence (fences alternate: open, close)."""
    return re.findall(r"^```(\S*)[ \t]*$", text, re.M)[::2]


def example_variables(directory: Path, env: dict[str, str]) -> dict[str, str]:
    """The variables ``otfload example DIR`` tells a reader to set (its ``export NAME=VALUE`` lines); the
    real console script in a process of its own (forked from tests.forked's server), as a newcomer runs it."""
    out = forked.run([str(Path(sys.executable).with_name("otfload")), "example", str(directory)], env=env,
                     timeout=300, check=True)  # fmt: skip
    return dict(shlex.split(line)[1].split("=", 1) for line in out.stdout.splitlines() if line.startswith("export "))


def test_every_code_block_runs(tmp_path):
    """The example command and the pages' interpreter: two fresh processes forked from one server (one
    environment: the imports done once for both)."""
    env = {**os.environ, "TQDM_DISABLE": "1", "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    variables = example_variables(tmp_path / "examples", env)
    assert sorted(variables) == ["OTFLOAD_EXAMPLE_ADAPTER", "OTFLOAD_EXAMPLE_CKPT", "OTFLOAD_EXAMPLE_QUANTIZED"]
    pages = [str(DOCS / p) for p in PAGES] + [str(README)]
    scratch = tmp_path / "cwd"
    scratch.mkdir()
    out = forked.run([sys.executable, "-c", RUNNER, str(WORKER), str(README), *pages], env={**env, **variables},
                     cwd=scratch, timeout=600)  # fmt: skip
    assert out.stdout.split() == [w for p in pages for w in ("ok", p)], out.stdout + out.stderr


def test_evaluation_page_shows_batched_generation():
    code = "\n".join(re.findall(r"```python\n(.*?)```", (DOCS / "evaluation.md").read_text(), re.S))
    assert "otfload.generate(" in code and "attention_mask=" in code


def test_every_fence_names_its_language():
    for page in [*(DOCS / p for p in PAGES), README]:
        languages = fence_languages(page.read_text())
        assert set(languages) <= FENCES, (page.name, languages)
    assert fence_languages("```python\nx = 1\n```\n\n```\nraw\n```\n") == ["python", ""]


def test_every_page_is_run_or_exempt():
    pages = {p.name for p in DOCS.glob("*.md")}
    assert pages == set(PAGES) | EXEMPT, pages ^ (set(PAGES) | EXEMPT)


def test_families_table_is_the_registry():
    table = re.findall(r"^\| `(\w+)` \|", (DOCS / "families.md").read_text(), re.M)
    assert sorted(table) == supported_model_types()


def test_troubleshooting_covers_every_typed_error():
    errors = {name for name, obj in vars(otfload.errors).items()
              if isinstance(obj, type) and issubclass(obj, otfload.errors.OtfloadError)}
    headings = set(re.findall(r"^### (\w+)$", (DOCS / "troubleshooting.md").read_text(), re.M))
    assert headings == errors


def test_the_pages_name_only_flags_their_commands_take():
    """Every ``otfload COMMAND ... --flag`` a page or README.md shows is a flag COMMAND takes, and the
    quickstart's table and index.md name every command."""
    from otfload.cli import build_parser

    commands = build_parser()._subparsers._group_actions[0].choices  # argparse lists them nowhere public
    takes = {name: {f for a in sub._actions for f in a.option_strings} for name, sub in commands.items()}
    names = "|".join(map(re.escape, commands))
    shown = re.compile(rf"otfload ({names})\b([^`\n|]*)")
    for page in [*DOCS.glob("*.md"), README]:
        for command, rest in shown.findall(page.read_text()):
            for flag in re.findall(r"(?<![\w-])(--[a-z][\w-]*)", rest):
                assert flag in takes[command], (page.name, command, flag)
    for page in ("quickstart.md", "index.md"):
        assert {c for c, _ in shown.findall((DOCS / page).read_text())} == set(commands), page


def test_links_between_pages_resolve():
    index_links = set(re.findall(r"\]\(([\w.]+\.md)", (DOCS / "index.md").read_text()))
    others = {"checkpoints.md", "export.md", "sources.md", "benchmarks.md", "reliability.md"}
    assert index_links >= {p for p in PAGES if p != "index.md"} | others
    for page in PAGES:
        for link in re.findall(r"\]\(([\w.]+\.md)", (DOCS / page).read_text()):
            assert (DOCS / link).exists(), (page, link)
