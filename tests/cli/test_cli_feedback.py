"""Feedback on long steps (issue 44 point 7): ``generate`` shows the load's bar and one of the new
tokens (it used to print nothing until done: its load bar was turned off); a misspelt lm-eval task
is refused with a did-you-mean before lm_eval is even imported (it used to wait for lm_eval's
~20 s task index); a Hub that cannot be reached says how to load from the local cache without a
network (``HF_HUB_OFFLINE``)."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from otfload.cli import main
from otfload.cli.task_names import unmentioned
from otfload.errors import SourceUnavailableError
from otfload.sources import open_source
from otfload.sources.retry import RetryPolicy


def test_generate_shows_the_load_and_the_new_tokens(example_checkpoints, capsys):
    assert main(["generate", str(example_checkpoints.llama), "--prompt", "the quick", "--max-new-tokens", "4",
                 "--progress"]) == 0
    err = capsys.readouterr().err
    assert "otfload: 100%" in err and "B/s" in err  # the load, in bytes
    assert "generate:" in err and "4/4" in err  # the new tokens
    assert main(["generate", str(example_checkpoints.llama), "--prompt", "the quick", "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_names_hf_hub_offline(tmp_path):
    endpoint = f"http://127.0.0.1:{closed_port()}"  # refused at once, as a machine without a network
    with pytest.raises(SourceUnavailableError, match=r"unreachable after 2 attempt\(s\).*Without a network, "
                                                     r"HF_HUB_OFFLINE=1 \(or local_files_only=True\) loads"):
        open_source("org/model", endpoint=endpoint, cache_dir=tmp_path,
                    retry=RetryPolicy(attempts=2, base_delay_s=0.01))


def test_a_misspelt_task_is_refused_before_lm_eval_is_imported(tmp_path):
    pytest.importorskip("lm_eval")
    from tests.lmeval.tasks import write_tasks

    tasks = write_tasks(tmp_path / "tasks")
    missing, defined = unmentioned(["otf_mcc", "otf_mc", "arc_easy", "mmlu_*", str(tasks / "otf_ppl.yaml")], str(tasks))
    assert missing == ["otf_mcc"] and {"otf_mc", "arc_easy"} <= set(defined)  # a pattern is lm_eval's to match
    argv = ["lm-eval", str(tmp_path / "no-checkpoint"), "--tasks", "otf_mcc", "--include-path", str(tasks)]
    probe = f"import sys\nfrom otfload.cli import main\nprint(main({argv!r}), 'lm_eval' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["2", "False"], done.stderr
    assert "no lm_eval task or group named 'otf_mcc' (did you mean 'otf_mc'" in done.stderr
