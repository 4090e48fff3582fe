"""``otfload export`` shows the bytes it writes on stderr (as the load shows the bytes it reads),
and ``--no-progress`` turns both bars off."""

from __future__ import annotations

import re

from otfload.cli import main


def bars(err: str) -> dict[str, str]:
    """Each tqdm bar's last state on stderr, by its description."""
    found = {}
    for line in re.split(r"[\r\n]", err):
        if match := re.match(r"^(otfload(?: export)?): +(\d+%)\|", line):
            found[match.group(1)] = match.group(2)
    return found


def test_export_shows_the_write_and_no_progress_hides_it(example_checkpoints, tmp_path, capsys):
    llama = str(example_checkpoints.llama)
    assert main(["export", llama, str(tmp_path / "shown"), "--progress", "--max-shard-size", "200KB"]) == 0
    assert bars(capsys.readouterr().err) == {"otfload": "100%", "otfload export": "100%"}
    assert main(["export", llama, str(tmp_path / "hidden"), "--no-progress"]) == 0
    assert bars(capsys.readouterr().err) == {}
