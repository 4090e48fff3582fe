"""The commands close what they open: after ``otfload load`` / ``bench`` returns, no file descriptor
and no mapping of the process refers to the checkpoint.

Each test loads a private copy of the tiny checkpoint, so only this command's source could hold its
files: the kernel's own lists (``/proc/self/fd``, ``/proc/self/maps``) are the reference.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from otfload.cli import main

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self")


def held_files(directory: Path) -> list[str]:
    """Paths under ``directory`` that this process holds open (descriptors) or mapped."""
    root = str(directory.resolve())
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the descriptor listdir itself used, closed meanwhile
            continue
        if target.startswith(root + os.sep):
            held.append(f"fd {fd} → {target}")
    with open("/proc/self/maps") as maps:
        held += [f"mapped {line.split()[-1]}" for line in maps if root + os.sep in line]
    return held


@pytest.fixture
def private_llama(tiny_checkpoints, tmp_path) -> Path:
    """A copy of the tiny llama that no other test (or cached source) has opened."""
    return Path(shutil.copytree(tiny_checkpoints("llama")[0], tmp_path / "llama"))


@pytest.mark.parametrize("command", [["load"], ["bench", "--repeats", "2"]])
def test_command_leaves_no_checkpoint_file_open(private_llama, command, capsys):
    assert held_files(private_llama) == []
    assert main([command[0], str(private_llama), *command[1:]]) == 0
    assert "GB/s" in capsys.readouterr().out  # it did load (the load report's throughput)
    assert held_files(private_llama) == []


def test_failed_load_leaves_no_checkpoint_file_open(private_llama, capsys):
    """A load that fails after reading the source (its config names a layer it lacks) closes it too."""
    config_file = private_llama / "config.json"
    config = json.loads(config_file.read_text())
    config["num_hidden_layers"] += 1
    config_file.write_text(json.dumps(config))
    assert main(["load", str(private_llama)]) == 1
    assert "ConfigError: config.json: num_hidden_layers" in capsys.readouterr().err
    assert held_files(private_llama) == []
