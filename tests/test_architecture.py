"""Imports run one way: every ``otfload`` module imports only from its own stage or earlier ones.

The stages (docs/architecture.md) are the pipeline — accounting → sources → index → plan → read → place → api
— with the model-side packages beside it (config, models, families, mappings: what the plan is
computed *for*) and the consumers after it. Each module's imports are read with ``ast`` (function-
level and ``TYPE_CHECKING`` imports count too), so a backwards import fails here even when it is
lazy. A module in no stage fails too: a new package must say where it sits, here and in the map of
docs/architecture.md, which must name every package and module of ``otfload/`` at its stage.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "otfload"  # read as text: nothing is imported

# Earliest first; a module may import from its own stage or any earlier one.
STAGES: tuple[tuple[str, ...], ...] = (
    ("errors", "atomic", "pages", "held", "gcpause"),  # errors, atomic dirs, madvise, held settings, GC pause
    ("accounting",),  # byte accounting: which gaps and pages a fetch reads, request sizes, counting what moved
    # bytes by range: local / Hub / fsspec; the shard cache in front of one; the processes of a job and their store
    ("sources", "cache", "coordination"),
    ("index",),  # safetensors headers, config.json, quantized formats
    ("quantized",),  # the device-side array of a weight kept packed (index.quant's codes)
    ("plan",),  # target leaf <- HF keys, hooks, boxes, sharding: from headers alone
    ("config", "models", "families", "mappings"),  # beside the pipeline: what a plan is made for
    ("read",),  # boxes of tensors from a source
    ("place",),  # read -> hooks -> stack -> place, the load report
    ("adapters",),  # LoRA adapters merged into the index and the reads
    # LoadOptions; the front door: source, shard cache, index; optional features as stages (adapters, kept ...)
    ("options", "opening", "stages"),
    ("api", "replicated"),  # from_pretrained, load_params, plan_model; leaves a mesh divides nowhere
    # native checkpoints, decoding, training start-up, compiled programs kept across jobs and where
    ("checkpoint", "generate", "tokenizer", "training", "programs", "compile_cache"),
    # back to HF safetensors; eval jobs; the lm-evaluation-harness backend; MaxText's trees (load_params, export);
    # the docs' example checkpoints (written with export's writer)
    ("export", "evaluate", "lm_eval", "maxtext", "examples"),
    ("cli",),  # the command line
    ("__init__",),  # the package's public names
)
STAGE = {name: i for i, names in enumerate(STAGES) for name in names}

# Backwards imports known today, each with the reason it is not fixed yet. The test fails when one
# is fixed (remove it here) as well as when a new one appears.
KNOWN_BACKWARDS: dict[tuple[str, str], str] = {}


def stage_of(module: str) -> str:
    """The stage name of ``otfload.<module...>``: its top-level package or module."""
    parts = module.split(".")
    return "__init__" if len(parts) == 1 else parts[1]


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path, module: str) -> set[str]:
    """Every ``otfload...`` module ``path`` imports, relative imports resolved."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "otfload"}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                names = [".".join([*base, node.module])] if node.module else [".".join([*base, a.name])
                                                                              for a in node.names]
            else:
                names = [node.module or ""]
            out |= {name for name in names if name.split(".")[0] == "otfload"}
    return out


def backwards_imports() -> dict[tuple[str, str], list[str]]:
    """``{(importer stage, imported stage): ["file: module", ...]}`` for imports of a later stage."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(ROOT.rglob("*.py")):
        module = module_name(path)
        mine = stage_of(module)
        assert mine in STAGE, f"{path}: otfload.{mine} is in no stage; add it to STAGES (and docs/architecture.md)"
        for target in imported_modules(path, module):
            theirs = stage_of(target)
            assert theirs in STAGE, f"{path} imports {target}, in no stage"
            if STAGE[theirs] > STAGE[mine]:
                found.setdefault((mine, theirs), []).append(f"{path.relative_to(ROOT.parent)}: {target}")
    return found


def test_imports_run_one_way():
    found = backwards_imports()
    new = {k: v for k, v in found.items() if k not in KNOWN_BACKWARDS}
    assert not new, f"imports from a later stage: {new}"
    fixed = set(KNOWN_BACKWARDS) - set(found)
    assert not fixed, f"fixed (remove from KNOWN_BACKWARDS): {sorted(fixed)}"


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    # The checker's own reference: a module with a function-level import and a relative one.
    pkg = tmp_path / "otfload" / "plan"
    pkg.mkdir(parents=True)
    src = pkg / "x.py"
    src.write_text("from . import boxes\n\ndef f():\n    from otfload.place.report import leaf_reads\n")
    assert imported_modules(src, "otfload.plan.x") == {"otfload.plan.boxes", "otfload.place.report"}
    assert STAGE[stage_of("otfload.place.report")] > STAGE[stage_of("otfload.plan.x")]


def map_rooms(text: str) -> dict[str, int]:
    """``{room: stage}`` from the map of docs/architecture.md: each line of its ``otfload/`` block names
    rooms (``name/`` a package, ``name.py`` a module) and, after them, their stage."""
    block = re.search(r"```text\notfload/\n(.*?)```", text, re.S)
    assert block, "docs/architecture.md has no ```text map starting with otfload/"
    rooms = {}
    for line in block.group(1).splitlines():
        row = re.match(r"  (\S+(?:  \S+)*) +(\d+)  ", line)
        if row:
            rooms |= {name.removesuffix("/").removesuffix(".py"): int(row.group(2)) for name in row.group(1).split()}
    return rooms


def test_the_map_names_every_room_at_its_stage():
    rooms = map_rooms((ROOT.parent / "docs" / "architecture.md").read_text())
    on_disk = {p.stem for p in ROOT.glob("*.py")} | {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert set(rooms) == on_disk, f"missing from the map: {on_disk - set(rooms)}, gone: {set(rooms) - on_disk}"
    assert rooms == {name: STAGE[name] for name in rooms}  # each at its stage of STAGES


# Modules below the front door that read the environment, each with the reason it cannot take the
# value as an argument. Everything else gets its settings from the load's options
# (otfload.options.environment reads the OTFLOAD_* variables once, when a load resolves its options).
ENVIRONMENT_READERS: dict[str, str] = {
    "otfload/sources/hub.py": "HF_ENDPOINT: huggingface_hub's own variable, read as huggingface_hub reads it when "
                              "a Hub source is opened without endpoint=",
    "otfload/sources/http_body.py": "SSL_CERT_FILE / SSL_CERT_DIR: the system's TLS trust store, as every HTTP "
                                    "client reads it",
}


def environment_reads(path: Path) -> list[int]:
    """The lines of ``path`` that touch ``os.environ`` or call ``os.getenv`` (however imported)."""
    tree = ast.parse(path.read_text(), str(path))
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in ("environ", "getenv", "environb"):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os":
            lines += [node.lineno for a in node.names if a.name in ("environ", "getenv", "environb")]
    return sorted(lines)


def test_nothing_below_the_front_door_reads_the_environment():
    front = STAGE["options"]
    readers = {}
    for path in sorted(ROOT.rglob("*.py")):
        stage = STAGE.get(stage_of(module_name(path)))
        if stage is not None and stage < front and (lines := environment_reads(path)):
            readers[str(path.relative_to(ROOT.parent))] = lines
    unexplained = {p: lines for p, lines in readers.items() if p not in ENVIRONMENT_READERS}
    assert not unexplained, f"below the front door, reading the environment (take an argument): {unexplained}"
    stale = set(ENVIRONMENT_READERS) - set(readers)
    assert not stale, f"no longer read (remove): {stale}"


def test_the_environment_checker_sees_every_spelling(tmp_path):
    src = tmp_path / "x.py"
    src.write_text("import os\nfrom os import environ\nos.environ.get('A')\nos.getenv('B')\n")
    assert environment_reads(src) == [2, 3, 4]
