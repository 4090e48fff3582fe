"""Feedback on long steps (issue 44 point 7): ``generate`` shows the load's bar and one of the new
tokens (it used to print nothing until done: its load bar was turned off); a misspelt lm-eval task
is refused with a did-you-mean before lm_eval is even imported (it used to wait for lm_eval's
~20 s task index); a Hub that cannot be reached says how to load from the local cache without a
network (``HF_HUB_OFFLINE``), once its requests have been failing for ``RetryPolicy.notice_after_s``
(it used to wait out ~12 s of retries in silence)."""

from __future__ import annotations

import io
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest
from safetensors.numpy import save_file

from otfload.cli import main
from otfload.cli.messages import show_warning
from otfload.cli.task_names import unmentioned
from otfload.errors import SourceNotFoundError, SourceUnavailableError
from otfload.sources import open_source
from otfload.sources.base import read_bytes
from otfload.sources.hub import HubSource
from otfload.sources.retry import RetryPolicy

# Retries for 1 s, said after 0.4 s (NOTICE_AFTER_S, 2 s, scaled down).
PATIENT = RetryPolicy(attempts=1000, base_delay_s=0.02, max_delay_s=0.05, deadline_s=1.0, notice_after_s=0.4)
RETRYING = "otfload: warning: SourceRetryingWarning: "
HINT = "(set HF_HUB_OFFLINE=1 to use the local Hub cache only)\n"


def test_generate_shows_the_load_and_the_new_tokens(example_checkpoints, capsys):
    assert (
        main(
            ["generate", str(example_checkpoints.llama), "--prompt", "the quick", "--max-new-tokens", "4", "--progress"]
        )
        == 0
    )
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
    with pytest.raises(
        SourceUnavailableError,
        match=r"unreachable after 2 attempt\(s\).*Without a network, "
        r"HF_HUB_OFFLINE=1 \(or local_files_only=True\) loads",
    ):
        open_source(
            "org/model", endpoint=endpoint, cache_dir=tmp_path, retry=RetryPolicy(attempts=2, base_delay_s=0.01)
        )


@contextmanager
def shown_warnings() -> Iterator[list[tuple[float, str]]]:
    """The warnings of the block as the command line prints them, each with when (seconds into the block)."""
    shown: list[tuple[float, str]] = []
    start = time.monotonic()

    def show(message, category, filename, lineno, file=None, line=None):
        text = io.StringIO()
        show_warning(message, category, filename, lineno, text)
        shown.append((time.monotonic() - start, text.getvalue()))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        yield shown


def test_an_unreachable_hub_says_once_past_the_threshold_that_it_retries(tmp_path):
    port = closed_port()
    start = time.monotonic()
    with shown_warnings() as shown, pytest.raises(SourceUnavailableError, match="HF_HUB_OFFLINE=1"):
        open_source("org/model", endpoint=f"http://127.0.0.1:{port}", cache_dir=tmp_path, retry=PATIENT)
    failed_after = time.monotonic() - start
    ((at, text),) = shown  # once
    assert text.startswith(f"{RETRYING}127.0.0.1:{port}: unreachable for "), text
    assert PATIENT.notice_after_s <= at < failed_after  # said past the threshold, while retrying
    assert (
        "(ConnectError: [Errno 111] Connection refused)" in text and "retrying up to " in text and text.endswith(HINT)
    )


class SmallChunks(HubSource):
    chunk_bytes = 4096  # a 64 KiB read is 16 requests at once


def test_one_notice_for_all_the_requests_of_a_load(hub, tmp_path):
    save_file({"w": np.zeros(16384, np.float32)}, str(tmp_path / "model.safetensors"))
    hub.add_repo("org/chunks", tmp_path)
    source = SmallChunks("org/chunks", endpoint=hub.url, cache_dir=tmp_path / "hf", retry=PATIENT)
    hub.stop()  # the next test's ``hub`` starts it again
    with shown_warnings() as shown, pytest.raises(SourceUnavailableError):
        read_bytes(source, "model.safetensors")
    ((at, text),) = shown
    assert at >= PATIENT.notice_after_s and text.startswith(f"{RETRYING}{hub.url.removeprefix('http://')}: ")
    assert text.endswith(HINT)


@pytest.mark.parametrize(("notice_after_s", "notices"), [(0.0, 1), (5.0, 0)])
def test_a_short_burst_of_503s_is_announced_only_past_the_threshold(hub, tmp_path, notice_after_s, notices):
    hub.add_repo("org/burst", tmp_path)
    hub.faults.fail_next = 3  # ridden out in ~0.1 s
    retry = RetryPolicy(attempts=10, base_delay_s=0.02, max_delay_s=0.05, notice_after_s=notice_after_s)
    with shown_warnings() as shown:
        open_source("org/burst", endpoint=hub.url, cache_dir=tmp_path / "hf", retry=retry)
    assert len(shown) == notices and all("(HTTP 503)" in text for _, text in shown)


def test_a_fast_failure_says_nothing_of_retries(hub, tmp_path):
    with shown_warnings() as shown, pytest.raises(SourceNotFoundError, match="repository not found"):  # a 404
        open_source("org/absent", endpoint=hub.url, cache_dir=tmp_path, retry=RetryPolicy(notice_after_s=0.0))
    assert shown == []


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
