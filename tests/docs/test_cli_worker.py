"""tests/docs/cli_worker.py runs a page's ``otfload`` commands as the console script would: the same
output on the same descriptors and the same exit status, checked against the real console script."""

from __future__ import annotations

import subprocess

import pytest

from tests.docs.cli_worker import CONSOLE_SCRIPT, Worker

COMMANDS = ["--version", "inspect --no-such-flag", "load SOURCE --verfy", "inspect"]


def console_script(command: str) -> tuple[str, str, int]:
    done = subprocess.run(f"{CONSOLE_SCRIPT} {command}", shell=True, capture_output=True, text=True, timeout=120)
    return done.stdout, done.stderr, done.returncode


def test_commands_print_and_exit_as_the_console_script(tmp_path):
    with Worker() as worker:
        for i, command in enumerate(COMMANDS):
            block = f'cd {tmp_path}; set +e; otfload {command} > {i}.out 2> {i}.err; echo "$?" > {i}.code'
            worker.run_bash(block, stdout=subprocess.DEVNULL)
            ran = tuple((tmp_path / f"{i}.{part}").read_text() for part in ("out", "err", "code"))
            want = console_script(command)
            assert ran == (want[0], want[1], f"{want[2]}\n"), command
        # the commands above ran in this process: the client comes first on PATH
        worker.run_bash(f'test "$(command -v otfload)" != {CONSOLE_SCRIPT}', stdout=subprocess.DEVNULL)
        with pytest.raises(subprocess.CalledProcessError) as failed:
            worker.run_bash("otfload inspect | cat", stdout=subprocess.DEVNULL)  # pipefail sees the usage error
        assert failed.value.returncode == 2
