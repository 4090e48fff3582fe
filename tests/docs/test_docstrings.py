"""The public API's docstrings: NumPy-style sections naming every parameter (a class: every field),
no Sphinx roles, and an example that runs as written (``./tiny-llama`` is the tiny Llama of the
``tiny_checkpoints`` fixture)."""

from __future__ import annotations

import doctest
import inspect
import re

import pytest

import otfload

PUBLIC = [otfload.from_pretrained, otfload.load_params, otfload.plan_model, otfload.plan_params, otfload.export_hf]
CLASSES = [otfload.LoadOptions]
SECTIONS = ("Parameters", "Returns", "Raises", "Examples")
CLASS_SECTIONS = ("Parameters", "Raises", "Examples")  # a class returns nothing


def documented_parameters(doc: str) -> set[str]:
    """The names the Parameters section describes (``a, b, **c`` lines name several)."""
    section = re.split(r"\n\n    (?:Returns|Raises)\n", doc.split("Parameters\n    ----------\n", 1)[1], maxsplit=1)[0]
    heads = re.findall(r"^    (\S.*?)$", section.replace("\\\n", ""), re.M)
    return {name.strip().lstrip("*") for head in heads for name in head.split(",")}


@pytest.mark.parametrize("function", PUBLIC + CLASSES, ids=lambda f: f.__name__)
def test_numpy_style_sections_name_every_parameter(function):
    doc = function.__doc__
    sections = CLASS_SECTIONS if isinstance(function, type) else SECTIONS
    positions = [doc.index(f"\n    {name}\n    {'-' * len(name)}\n") for name in sections]
    assert positions == sorted(positions), function.__name__
    assert not re.search(r":(func|class|mod|meth|data|attr):`", doc)
    assert documented_parameters(doc) == set(inspect.signature(function).parameters)


@pytest.mark.parametrize("function", PUBLIC + CLASSES, ids=lambda f: f.__name__)
def test_the_example_runs(function, tiny_checkpoints, tmp_path, monkeypatch):
    (tmp_path / "tiny-llama").symlink_to(tiny_checkpoints("llama")[0], target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    test = doctest.DocTestParser().get_doctest(function.__doc__, {}, function.__name__, None, 0)
    assert len(test.examples) >= 3
    runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
    report: list[str] = []
    runner.run(test, out=report.append)
    assert runner.failures == 0, "".join(report)
