"""The ``reshard`` option of a load: a keyword of ``from_pretrained``/``load_params``, the
``OTFLOAD_RESHARD`` environment variable under it, ``otfload load --reshard``; bad values are typed
errors naming where they came from. (That each value changes what a multi-process load reads —
``LoadReport.resharded`` — is tested on real processes in tests/multihost/test_fetch.py.)"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import otfload
from otfload.cli import main
from otfload.errors import InvalidOptionError, OtfloadError
from otfload.options import resolve_options
from otfload.place.collective_route import RESHARD_ENV, resolve_policy


def test_the_keyword_wins_over_the_environment_which_wins_over_auto(monkeypatch):
    monkeypatch.delenv(RESHARD_ENV, raising=False)
    assert resolve_policy(resolve_options(None, {}).reshard) == "auto"
    monkeypatch.setenv(RESHARD_ENV, "always")
    assert resolve_policy(resolve_options(None, {}).reshard) == "always"  # read at the front door
    assert resolve_policy(resolve_options(None, {"reshard": "never"}).reshard) == "never"
    assert resolve_policy(None) == "auto"  # below the front door: no environment


@pytest.mark.parametrize("call", ["from_pretrained", "load_params"])
def test_a_bad_value_fails_typed_before_the_source_is_opened(call, tmp_path):
    missing = tmp_path / "no-such-checkpoint"  # opening it would raise SourceNotFoundError
    with pytest.raises(InvalidOptionError, match=r"reshard='sometimes': expected one of 'auto', 'always', 'never'"):
        if call == "from_pretrained":
            otfload.from_pretrained(missing, reshard="sometimes")
        else:
            otfload.load_params(missing, {}, {}, reshard="sometimes")


def test_a_bad_environment_value_names_the_variable_and_an_explicit_keyword_overrides_it(
    monkeypatch, tiny_checkpoints, mesh_2x4
):
    directory = tiny_checkpoints("llama")[0]
    monkeypatch.setenv(RESHARD_ENV, "bogus")
    with pytest.raises(InvalidOptionError, match=f"{RESHARD_ENV}='bogus'") as e:
        otfload.from_pretrained(directory, mesh=mesh_2x4)
    assert isinstance(e.value, OtfloadError) and isinstance(e.value, ValueError)
    model, report = otfload.from_pretrained(directory, mesh=mesh_2x4, reshard="never", return_report=True)
    assert report.resharded == [] and report.leaves > 0  # one process: every box is local
    kernel = np.asarray(model.lm_head.kernel[...])
    assert isinstance(model.lm_head.kernel[...], jax.Array) and np.isfinite(kernel).all()


def test_otfload_load_takes_reshard(tiny_checkpoints, capsys):
    directory = tiny_checkpoints("llama")[0]
    assert main(["load", str(directory), "--mesh", "fsdp=2,tp=4", "--reshard", "always"]) == 0
    assert "loaded" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["load", str(directory), "--reshard", "sometimes"])
    assert e.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err
