"""CLI habits (issue 44 point 5): every subcommand that loads or plans a model takes the same load
flags, built once (``--adapter``, ``--merge-adapter``, ``--quantized``, ``--reshard``); ``--debug``
after the subcommand; ``inspect --json`` with every HF key and shardings as spec lists; ``load --json``."""

from __future__ import annotations

import json

import pytest

from otfload.cli import build_parser, main
from otfload.cli.options import load_options
from otfload.plan.sharding import logical_to_spec
from tests.cli.test_cli import otfload_cli

LOADING = {  # each subcommand that loads or plans, with the arguments it requires
    "inspect": [], "load": [], "bench": [], "eval": ["--data", "x.jsonl"], "generate": ["--prompt", "hi"],
    "lm-eval": ["--tasks", "t"],
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


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["load", "--help"], ["lm-eval", "--help"]])
def test_help_and_version_import_neither_jax_nor_the_pipeline(argv):
    import subprocess
    import sys

    probe = (f"import sys\nfrom otfload.cli import main\ntry:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
             "print(sorted(m for m in ('jax', 'flax', 'ml_dtypes', 'otfload.api') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "[]"  # what made them take ~3 s
