"""A small run of ``scripts/fuzz_configs.py`` (the full run uses 10,000 cases): fuzzed configs and
headers of every family's tiny checkpoint end in a typed error or a load whose every weight is checked
against the files, each within the script's time limit."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from collections import Counter
from pathlib import Path

import tests.config.support  # noqa: F401  (registers every family's tiny model kind)

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "fuzz_configs.py"
CASES = 200


def load_script():
    spec = importlib.util.spec_from_file_location("fuzz_configs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the script runs
    spec.loader.exec_module(module)
    return module


def test_fuzzed_configs_end_in_typed_errors_or_correct_loads(tiny_checkpoints, tmp_path):
    fuzz = load_script()
    bases = {kind: shutil.copytree(tiny_checkpoints(kind)[0], tmp_path / kind) for kind in fuzz.KINDS}
    fuzzer = fuzz.Fuzzer(bases, tmp_path)
    fuzzer.run(CASES, raise_on_failure=True)
    assert len(fuzzer.results) == CASES and not fuzzer.failures()
    outcomes = Counter(o.outcome for _, o in fuzzer.results)
    # Not vacuous: the cases reach validation errors, planning errors and verified loads alike.
    assert outcomes["ConfigError"] > CASES // 4 and outcomes["loaded"] > 10 and outcomes["MissingTensorError"] > 0
    assert max(o.seconds for _, o in fuzzer.results) < fuzz.CASE_LIMIT_S
    assert "| valid |" in fuzzer.summary()
