"""CLI habits (issue 44 points 5 and 8): every subcommand that loads or plans a model takes the same
load flags, built once (``--adapter``, ``--merge-adapter``, ``--quantized``, ``--reshard``), export
included, each a ``LoadOptions`` field with the values it allows; ``--debug`` after the subcommand;
``inspect --json`` with every HF key and shardings as spec lists; ``load``, ``bench`` and ``export``
``--json`` (``reshard --json``: tests/cli/test_cli.py);
``--help`` and ``--version`` without numpy, JAX or the pipeline."""

from __future__ import annotations

import dataclasses
import json

import pytest

from otfload.cli import build_parser, main
from otfload.cli.options import LOAD_FLAGS as OPTION_FLAGS
from otfload.cli.options import load_options
from otfload.options import LoadOptions
from otfload.place.collective_route import POLICIES as RESHARD_POLICIES
from otfload.plan.keep import QUANTIZED_MODES
from otfload.plan.sharding import logical_to_spec
from tests.cli.test_cli import otfload_cli

LOADING = {  # each subcommand that loads or plans, with the arguments it requires
    "inspect": [], "load": [], "bench": [], "eval": ["--data", "x.jsonl"], "generate": ["--prompt", "hi"],
    "lm-eval": ["--tasks", "t"], "export": ["out"],
}
LOAD_FLAGS = ["--adapter", "a", "--adapter", "b", "--quantized", "keep", "--reshard", "never", "--debug"]


@pytest.mark.parametrize("command", sorted(LOADING))
def test_every_loading_subcommand_takes_the_same_load_flags(command):
    args = build_parser().parse_args([command, "src", *LOADING[command], *LOAD_FLAGS])
    options = load_options(args, mesh=False)
    assert (options.adapter, options.quantized, options.reshard) == (["a", "b"], "keep", "never")
    assert args.debug  # after the subcommand too
    args = build_parser().parse_args([command, "src", *LOADING[command], "--adapter", "a", "--no-merge-adapter"])
    assert load_options(args, mesh=False).merge_adapter is False


def test_the_load_flags_are_the_options_fields_with_their_allowed_values():
    fields = {f.name for f in dataclasses.fields(LoadOptions)}
    allowed = {"quantized": set(QUANTIZED_MODES), "reshard": set(RESHARD_POLICIES)}
    subcommands = build_parser()._subparsers._group_actions[0].choices  # argparse lists them nowhere public
    for command in LOADING:
        actions = {a.dest: a for a in subcommands[command]._actions}
        assert set(OPTION_FLAGS) | {"mesh", "devices"} <= set(actions), command  # the same flags everywhere
        assert set(OPTION_FLAGS) <= fields
        for name, values in allowed.items():
            assert set(actions[name].choices) == values, (command, name)


def test_every_command_that_works_takes_json():
    subcommands = build_parser()._subparsers._group_actions[0].choices
    lacking = {name for name, sub in subcommands.items() if "--json" not in sub._option_string_actions}
    assert lacking == {"example"}  # it prints the shell lines to eval


def test_debug_before_or_after_the_subcommand():
    parse = build_parser().parse_args
    assert [parse(argv).debug for argv in (["--debug", "load", "x"], ["load", "x", "--debug"], ["load", "x"])] == \
        [True, True, False]


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints("llama")[0]


def test_inspect_json_gives_every_hf_key_and_specs_as_lists(llama, mesh_2x4):
    import otfload

    out = otfload_cli("inspect", llama, "--devices", "8", "--mesh", "fsdp=2,tp=4", "--json")
    assert out.returncode == 0, out.stderr
    info = {leaf["leaf"]: leaf for leaf in json.loads(out.stdout)["leaves"]}
    _, plan, source = otfload.plan_model(llama, mesh=mesh_2x4)
    source.close()
    for path, p in plan.leaves.items():
        assert info[path]["hf_keys"] == [s.name for s in p.sources], path  # none elided
        assert len(info[path]["hf_keys"]) == info[path]["num_hf_keys"]
        want = logical_to_spec(p.leaf.logical_axes, p.leaf.shape, mesh_2x4)
        assert info[path]["spec"] == [list(a) if isinstance(a, tuple) else a for a in want], path
        assert isinstance(info[path]["shape"], list)
    assert any(len(leaf["hf_keys"]) > 2 for leaf in info.values())  # stacked layers: every key listed


def test_load_json_is_the_report(llama, capsys):
    assert main(["load", str(llama), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["leaves"] == 12 and report["bytes_placed"] > 0 and report["source"]


def test_bench_json_gives_each_run_and_the_report(llama, capsys):
    assert main(["bench", str(llama), "--repeats", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [sorted(run) for run in out["runs"]] == [["bytes_read", "gbps", "seconds"]] * 2
    assert out["best_gbps"] == max(run["gbps"] for run in out["runs"]) > 0
    assert out["report"]["leaves"] == 12 and out["report"]["bytes_read"] == out["runs"][-1]["bytes_read"]


def test_export_json_lists_what_it_wrote(llama, tmp_path, capsys):
    assert main(["export", str(llama), str(tmp_path / "out"), "--max-shard-size", "200KB", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["source"] == str(llama) and out["out"] == str(tmp_path / "out")
    assert out["files"] == sorted(p.name for p in (tmp_path / "out").iterdir())
    assert "config.json" in out["files"] and "model.safetensors.index.json" in out["files"]


@pytest.mark.parametrize("flag", [["--quantized", "keep"], ["--no-merge-adapter"]])
def test_export_refuses_load_flags_it_cannot_write_before_loading(flag, tmp_path, capsys):
    missing = tmp_path / "no-such-checkpoint"  # opening it would be a SourceNotFoundError (exit 1)
    assert main(["export", str(missing), str(tmp_path / "out"), *flag]) == 2
    assert "--quantized keep and --no-merge-adapter do not apply" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["load", "--help"], ["lm-eval", "--help"]])
def test_help_and_version_import_neither_jax_nor_the_pipeline(argv):
    import resource
    import subprocess
    import sys

    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    probe = (f"import sys\nfrom otfload.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('jax', 'flax', 'ml_dtypes', 'numpy', 'otfload.api') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"  # what made them take ~3 s (numpy: ~0.3 s)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # CPU seconds: the shared machine's wall time varies
    assert after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime < 0.5
