"""``LoadOptions``: one object every entry point takes, checked once when it is made; keyword
arguments merge into it (a repeat that disagrees is an error, not a silent winner); the command
line builds it from its flags in one place; and the keyword types a type checker reads name the
same fields with the same types."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx

import otfload
from otfload.cli import build_parser
from otfload.cli.options import load_options
from otfload.errors import AdapterError, InvalidOptionError
from otfload.options import MODEL_FIELDS, LoadKeywords, LoadOptions, ParamsKeywords, resolve_options


def annotations(typed_dict: type) -> dict[str, str]:
    return {name: ref.__forward_arg__ for name, ref in typed_dict.__annotations__.items()}


def test_the_keyword_types_name_every_field_with_its_type():
    fields = {f.name: f.type for f in dataclasses.fields(LoadOptions)}
    assert annotations(LoadKeywords) == fields
    assert annotations(ParamsKeywords) == {k: v for k, v in fields.items() if k not in MODEL_FIELDS}
    assert set(MODEL_FIELDS) < set(fields)


@pytest.mark.parametrize(("field", "value", "message"), [
    ("quantized", "packed", "quantized='packed': expected one of 'dequantize', 'keep'"),
    ("reshard", "sometimes", "reshard='sometimes': expected one of 'auto', 'always', 'never'"),
    ("verify", "fast", "verify='fast': expected one of 'record', 'full'"),
])
def test_bad_values_are_typed_errors_when_the_object_is_made(field, value, message, tmp_path):
    with pytest.raises(InvalidOptionError, match=message):
        LoadOptions(**{field: value})
    missing = tmp_path / "no-such-checkpoint"  # opening it would raise SourceNotFoundError
    for call in (lambda: otfload.from_pretrained(missing, **{field: value}),
                 lambda: otfload.plan_model(missing, **{field: value}),
                 lambda: otfload.load_params(missing, {}, {}, **{field: value})):
        with pytest.raises(InvalidOptionError, match=message):
            call()


def test_adapter_values_are_checked_too():
    with pytest.raises(AdapterError, match="2 adapters with merge_adapter=False"):
        LoadOptions(adapter=["a", "b"], merge_adapter=False)
    with pytest.raises(TypeError, match="adapter= must be a location"):
        LoadOptions(adapter=3)  # type: ignore[arg-type]
    assert LoadOptions(adapter="a").adapters == ["a"]
    assert LoadOptions().adapters == []


def test_keywords_merge_into_the_object_and_a_disagreeing_repeat_is_an_error(mesh_2x4):
    base = LoadOptions(mesh=mesh_2x4, dtype="bf16")
    merged = resolve_options(base, {"strict": True, "dtype": "bf16", "revision": "main"})
    assert (merged.mesh, merged.dtype, merged.strict, merged.revision) == (mesh_2x4, "bf16", True, "main")
    assert base.strict is False  # frozen: the caller's object is not changed
    assert resolve_options(base, {}) is base
    with pytest.raises(InvalidOptionError, match=r"dtype='float32' and options.dtype='bf16': give each option once"):
        resolve_options(base, {"dtype": "float32"})
    with pytest.raises(TypeError, match=r"unknown option\(s\) \['revison'\]"):
        resolve_options(None, {"revison": "main"})
    with pytest.raises(TypeError, match="LoadOptions, not dict"):
        resolve_options({"dtype": "bf16"}, {})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"\['dtype'\] do not apply here"):
        resolve_options(None, {"dtype": "bf16"}, unused=MODEL_FIELDS)


def test_source_options_are_those_set_away_from_their_defaults():
    options = LoadOptions(revision="v1", mmap=False, local_files_only=False, dtype="bf16", timeout=3.0)
    assert options.source_options() == {"revision": "v1", "mmap": False, "timeout": 3.0}


def test_an_object_and_keywords_load_the_same_model(tiny_checkpoints, mesh_2x4):
    path = tiny_checkpoints("llama")[0]
    by_keywords = otfload.from_pretrained(path, mesh=mesh_2x4, dtype="bf16", scan_layers=False)
    options = LoadOptions(mesh=mesh_2x4, dtype="bf16")
    by_object = otfload.from_pretrained(path, options=options, scan_layers=False)
    ours, theirs = (jax.tree.leaves(nnx.state(m, nnx.Param)) for m in (by_keywords, by_object))
    assert len(ours) == len(theirs) > 0
    for a, b in zip(ours, theirs, strict=True):
        assert a.dtype == b.dtype == np.dtype("bfloat16") and a.sharding == b.sharding
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match=r"\['scan_layers'\] do not apply here"):
        otfload.load_params(path, {}, {}, options=options, scan_layers=False)  # type: ignore[call-arg]


def test_the_command_line_builds_one_object_from_its_flags(tiny_checkpoints):
    path = str(tiny_checkpoints("llama")[0])
    args = build_parser().parse_args(["load", path, "--dtype", "bf16", "--no-scan-layers", "--revision", "v1",
                                      "--reshard", "never", "--adapter", "a", "--verify"])
    options = load_options(args)
    assert (options.dtype, options.scan_layers, options.revision, options.reshard, options.adapter) == \
        (np.dtype("bfloat16"), False, "v1", "never", ["a"])
    assert options.verify == "record"  # load --verify checks the model, not the shard cache's copies
    assert options.mesh is not None and options.mesh.shape == {"fsdp": len(jax.devices())}
    args = build_parser().parse_args(["inspect", path, "--quantized", "keep"])
    assert load_options(args, mesh=False) == LoadOptions(quantized="keep", reshard="auto")
