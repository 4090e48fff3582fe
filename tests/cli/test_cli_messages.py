"""What a command-line user reads: flags instead of Python arguments, the subcommand's usage for a
mistyped flag, ``--version``, paths never sent to the Hub, help text without Sphinx roles, and the
model named by its model_type."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from otfload.cli import build_parser, main
from otfload.cli.inspect import model_label
from otfload.cli.messages import cli_message
from otfload.errors import AdapterError, DeviceCountError, OutputExistsError
from otfload.sources import hub

OTFLOAD = Path(sys.executable).with_name("otfload")  # the console script pip installed


def otfload_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(OTFLOAD), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "TQDM_DISABLE": "1"})


@pytest.fixture(scope="module")
def llama(tiny_checkpoints) -> Path:
    return tiny_checkpoints("llama")[0]


@pytest.fixture
def no_hub(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if any Hub source is opened."""
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a Hub source was opened for {args[1:]}")

    monkeypatch.setattr(hub.HubSource, "__init__", refuse)


def test_flags_replace_python_arguments():
    assert cli_message(OutputExistsError("/o exists; pass overwrite=True to replace it")) == \
        "/o exists; pass --overwrite to replace it"
    assert cli_message(AdapterError("2 adapters with merge_adapter=False: ...; pass it as adapter=")) == \
        "2 adapters with --no-merge-adapter: ...; pass it as --adapter"
    assert cli_message(AdapterError("scan_layers=True was requested")) == "--scan-layers was requested"
    quoted = "not loaded with merge_adapter=False (from_pretrained(..., merge_adapter=False)); other_name=x"
    assert cli_message(AdapterError(quoted)) == quoted.replace("with merge_adapter=False", "with --no-merge-adapter", 1)


def test_device_count_hint():
    error = DeviceCountError({"fsdp": 2, "tp": 4}, 1)
    assert (error.needed, error.available) == (8, 1)
    assert "XLA_FLAGS=--xla_force_host_platform_device_count=8" in str(error)  # the library's hint
    assert "--devices 8" in cli_message(error) and "--mesh with sizes whose product is 1" in cli_message(error)


def test_a_checkpoint_file_is_not_sent_to_the_hub(llama, no_hub, capsys):
    shard = sorted(llama.glob("*.safetensors"))[0]
    assert main(["load", str(shard)]) == 1
    err = capsys.readouterr().err
    assert f"SourceNotFoundError: checkpoint location '{shard}' is a file, not a checkpoint directory" in err
    assert f"(here '{llama}/')" in err


def test_a_mistyped_relative_path_is_not_sent_to_the_hub(llama, tmp_path, monkeypatch, no_hub, capsys):
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "tinyqwen").symlink_to(llama, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", "work/tinyqwn"]) == 1
    err = capsys.readouterr().err
    assert "'work/tinyqwn' is not a local directory: it does not exist; the nearest existing parent is 'work/'" in err
    assert "Did you mean 'work/tinyqwen'?" in err
    assert main(["load", "tinyqwen/model.safetensors"]) == 1
    assert "file suffix is not tried as a Hub repo id" in capsys.readouterr().err


def test_a_mistyped_flag_shows_the_subcommands_usage():
    out = otfload_cli("load", ".", "--verfy")
    assert out.returncode == 2
    assert out.stderr.startswith("usage: otfload load ")
    assert "otfload load: error: unrecognized arguments: --verfy (did you mean --verify?)" in out.stderr
    with pytest.raises(SystemExit) as e:
        main(["inspect", ".", "--jsno", "extra"])
    assert e.value.code == 2


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    from importlib.metadata import version

    assert capsys.readouterr().out.strip() == f"otfload {version('otfload')}"


def test_help_has_no_sphinx_roles():
    commands = next(a for a in build_parser()._actions if a.dest == "command")
    for name, sub in commands.choices.items():
        text = sub.format_help()
        assert ":mod:" not in text and ":class:" not in text and "``" not in text, name
    inspect_help = commands.choices["inspect"].format_help()
    assert "byte counts, otfload.plan.leaf_bytes)" in " ".join(inspect_help.split())


def test_model_label():
    assert model_label("qwen3", "llama") == "qwen3"  # a supported model_type, built by the llama family
    assert model_label("llama", "llama") == "llama"
    assert model_label("llama", "custom mapping m:TABLE") == "llama (custom mapping m:TABLE)"
    assert model_label(None, "custom mapping m:TABLE") == "custom mapping m:TABLE"


def test_inspect_names_qwen3_by_its_model_type(tiny_checkpoints, capsys):
    path, _ = tiny_checkpoints("qwen3")
    assert main(["inspect", str(path)]) == 0
    assert "\nmodel        qwen3, scan_layers=True\n" in capsys.readouterr().out


def test_adapter_base_missing_names_adapter_config(tmp_path, no_hub, capsys, monkeypatch):
    from tests.adapters.support import lora_pair, write_adapter

    adapter = write_adapter(tmp_path / "lora", lora_pair("model.layers.0.self_attn.q_proj", 4, 64, 64),
                            base_model_name_or_path="tinyqwen")
    monkeypatch.chdir(tmp_path)
    assert main(["inspect", str(adapter)]) == 1
    err = capsys.readouterr().err
    assert f"adapter {adapter}: adapter_config.json names the base model base_model_name_or_path='tinyqwen'" in err
    assert f"a relative path is taken from the current directory, {tmp_path}" in err
    assert "this adapter as --adapter" in err


def test_generate_past_the_context_warns_in_cli_words(tiny_checkpoints, tmp_path, capsys):
    import json

    from tests.eval_support import with_tokenizer

    path = with_tokenizer(tiny_checkpoints("llama")[0], tmp_path / "short")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4}))
    assert main(["generate", str(path), "--prompt", "the quick brown fox", "--max-new-tokens", "2"]) == 0
    err = capsys.readouterr().err
    assert any(line.startswith("otfload: warning: ContextLengthWarning: a prompt of ") for line in err.splitlines())
    assert "more than the model's max_position_embeddings of 4 (config.json)" in err
    assert "warnings.warn" not in err  # Python's source-line echo is not shown
