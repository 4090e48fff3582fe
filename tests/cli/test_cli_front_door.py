"""The command line checks before it works and ends in one line (issue 44 point 2): bad sizes and an
existing output refused before a byte is loaded, a bad ``OTFLOAD_*`` variable a typed line without a
traceback, Ctrl-C one line with exit 130 and nothing half written, a failed reshard no empty DST,
lm-eval's task names and include path checked before lm_eval runs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from otfload.cli import INTERRUPTED, main
from otfload.cli.harness import check_tasks
from otfload.errors import InvalidOptionError
from tests.cli.test_cli import otfload_cli


@pytest.fixture(scope="module")
def llama(tiny_checkpoints):
    return tiny_checkpoints("llama")[0]


def test_a_bad_shard_size_is_usage_before_loading(llama, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["export", str(llama), str(tmp_path / "out"), "--max-shard-size", "banana"])
    assert e.value.code == 2
    assert "--max-shard-size: max_shard_size 'banana' is not a size such as '5GB'" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_an_existing_output_fails_before_the_source_is_opened(tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    # the source does not exist either: opening it first would say so instead
    assert main(["export", str(tmp_path / "no-such-checkpoint"), str(out)]) == 1
    assert capsys.readouterr().err.strip() == f"otfload: error: OutputExistsError: {out} exists; pass --overwrite " \
                                               "to replace it"


def test_a_bad_environment_variable_is_one_typed_line(llama):
    import os

    done = otfload_cli_env({"OTFLOAD_TIMEOUT": "abc"}, "inspect", llama)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == ("otfload: error: InvalidOptionError: $OTFLOAD_TIMEOUT='abc': expected a number "
                                   "of seconds > 0")
    assert "Traceback" not in done.stderr and os.environ.get("OTFLOAD_TIMEOUT") is None


def otfload_cli_env(env, *args):
    import os

    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return otfload_cli(*args)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k)
            else:
                os.environ[k] = v


def interrupt(*args, **kwargs):
    raise KeyboardInterrupt  # what Ctrl-C raises in the main thread, at this point of the work


def test_ctrl_c_in_export_is_one_line_exit_130_and_no_output(llama, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("otfload.export.writer.write_safetensors", interrupt)  # mid-write
    out = tmp_path / "out"
    assert main(["export", str(llama), str(out)]) == INTERRUPTED == 130
    assert capsys.readouterr().err == "otfload: export: interrupted\n"
    assert not out.exists() and list(tmp_path.iterdir()) == []  # nothing half written, no temporary left


def test_ctrl_c_in_load_is_one_line_exit_130(llama, monkeypatch, capsys):
    monkeypatch.setattr("otfload.place.loader.build_leaf", interrupt)  # while the leaves are built
    assert main(["load", str(llama)]) == 130
    assert capsys.readouterr().err == "otfload: load: interrupted\n"
    with pytest.raises(KeyboardInterrupt):  # --debug: the traceback
        main(["load", str(llama), "--debug"])


def test_ctrl_c_while_the_flags_are_parsed_is_one_line_exit_130(monkeypatch, capsys):
    monkeypatch.setattr("otfload.cli.build_parser", interrupt)  # a size flag's parser imports numpy: ~1 s loaded
    assert main(["export", "src", "out"]) == 130
    assert capsys.readouterr().err == "otfload: interrupted\n"
    with pytest.raises(KeyboardInterrupt):  # --debug: the traceback
        main(["export", "src", "out", "--debug"])


def test_ctrl_c_after_the_work_while_jax_shuts_down_is_ignored(llama):
    """The console script's command has finished (its output printed); a Ctrl-C during the
    interpreter's teardown neither prints a traceback nor changes the exit code."""
    import subprocess
    import sys

    probe = ("import os, signal, sys, time\nfrom otfload.cli import main\n"
             f"sys.argv = ['otfload', 'inspect', {str(llama)!r}]\ncode = main()\n"
             "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.2)\nsys.exit(code)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr
    assert "layers.attn.q.kernel" in done.stdout


def test_a_failed_reshard_leaves_no_empty_destination(tmp_path, capsys):
    (tmp_path / "src").mkdir()  # no checkpoint in it
    assert main(["reshard", str(tmp_path / "src"), str(tmp_path / "dst"), "--mesh", "fsdp=8"]) == 1
    assert "otfload: error:" in capsys.readouterr().err
    assert not (tmp_path / "dst").exists()


def test_unknown_task_names_get_a_did_you_mean():
    known = ["arc_easy", "capitals", "hellaswag"]
    check_tasks(["capitals"], known, lambda t: t in known)
    with pytest.raises(InvalidOptionError, match=r"no lm_eval task or group named 'capitalz' \(did you mean "
                                                 r"'capitals'\?\), 'zzz' \(3 known"):
        check_tasks(["capitalz", "arc_easy", "zzz"], known, lambda t: t in known)


def test_a_missing_include_path_is_reported(llama, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    missing = tmp_path / "no-tasks-here"
    assert main(["lm-eval", str(llama), "--tasks", "x", "--include-path", str(missing)]) == 2
    assert f"--include-path '{missing}': no such directory of lm_eval task files" in capsys.readouterr().err


def test_a_checkpoint_without_eos_is_the_checkpoints_error_before_lm_eval_runs(tiny_checkpoints, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    import json

    from tests.eval_support import with_tokenizer
    from tests.lmeval.tasks import write_tasks

    checkpoint = with_tokenizer(tiny_checkpoints("llama")[0], tmp_path / "no-eos")  # no tokenizer_config.json
    config = json.loads((checkpoint / "config.json").read_text())
    config.pop("eos_token_id", None)
    (checkpoint / "config.json").write_text(json.dumps(config))
    tasks = write_tasks(tmp_path / "tasks")

    def open_checkpoint_files() -> list[str]:
        fds = Path("/proc/self/fd")
        return [t for t in (os.path.realpath(fds / n) for n in os.listdir(fds)) if t.startswith(str(checkpoint))]

    assert main(["lm-eval", str(checkpoint), "--tasks", "otf_mc", "--include-path", str(tasks), "--limit", "2",
                 "--compile-cache", "off"]) == 1  # the checkpoint's error, not bad usage (2)
    err = capsys.readouterr().err
    assert "otfload: error: TokenizerError:" in err and "names no EOS token" in err
    assert open_checkpoint_files() == []  # the load it had started stopped, its files closed
