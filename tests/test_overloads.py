"""The ``@overload``s of ``from_pretrained`` / ``load_params`` (what a type checker reads to give the
return type for ``return_report=``) take exactly the parameters of the function they describe: a
parameter added to one and not the others fails here, not in a user's type checker."""

from __future__ import annotations

import inspect
import typing

import pytest

import otfload


@pytest.mark.parametrize("function", [otfload.from_pretrained, otfload.load_params])
def test_overloads_match_the_implementation(function):
    overloads = typing.get_overloads(function)
    assert len(overloads) == 2
    implementation = inspect.signature(function).parameters
    reports = set()
    for overload in overloads:
        params = inspect.signature(overload).parameters
        assert list(params) == list(implementation), overload
        for name, param in params.items():
            if name == "return_report":
                reports.add((param.annotation, param.default))
                continue
            theirs = implementation[name]
            assert (param.kind, param.default, param.annotation) == (theirs.kind, theirs.default, theirs.annotation)
    assert reports == {("Literal[False]", False), ("Literal[True]", inspect.Parameter.empty)}
