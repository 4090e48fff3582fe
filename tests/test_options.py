"""``LoadOptions``: one object every entry point takes, checked once when it is made; keyword
arguments merge into it (a repeat that disagrees is an error, not a silent winner); the command
line builds it from its flags in one place; and the keyword types a type checker reads name the
same fields with the same types."""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh

import otfload
from otfload.cli import build_parser
from otfload.cli.options import load_options
from otfload.errors import AdapterError, InvalidOptionError
from otfload.options import MODEL_FIELDS, LoadKeywords, LoadOptions, ParamsKeywords, resolve_options
from otfload.options.environment import environment


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
    assert (merged.mesh, merged.dtype, merged.strict, merged.revision) == (mesh_2x4, np.dtype("bfloat16"), True,
                                                                            "main")
    assert base.strict is False  # frozen: the caller's object is not changed
    assert resolve_options(base, {}) is base
    with pytest.raises(InvalidOptionError, match=r"dtype='float32' and options.dtype=dtype\(bfloat16\): give"):
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
    assert load_options(args, mesh=False) == LoadOptions(quantized="keep")  # --reshard unset: the environment decides


@pytest.mark.parametrize(("field", "value", "allowed"), [
    ("scan_layers", "no", "expected True or False"),  # not truthy: it used to load scanned
    ("scan_layers", "false", "expected True or False"),
    ("merge_adapter", "no", "expected True or False"),
    ("strict", 1, "expected True or False"),
    ("progress", "yes", "expected True or False"),
    ("dtype", "bfloat17", "expected one of 'bf16', 'fp16', 'float32', 'float64'"),
    ("dtype", "int8", "expected one of 'bf16'"),  # a cast to int8 used to load silently
    ("dtype", np.int32, "expected one of 'bf16'"),
    ("timeout", -1, "expected a number of seconds > 0 or None"),
    ("timeout", "10", "expected a number of seconds > 0"),
    ("workers", 0, "expected an integer >= 1 or None"),
    ("workers", "4", "expected an integer >= 1"),
    ("workers", True, "expected an integer >= 1"),
    ("host_memory_budget", -5, "expected an integer >= 1 or None"),
    ("host_ring_bytes", -1, "expected an integer >= 0 or None"),
    ("collective_timeout", 0, "expected a number of seconds > 0"),
    ("device_hooks", "sometimes", "expected one of 'auto', 'always', 'never'"),
    ("mesh", (2, 4), "expected a jax.sharding.Mesh, a spec such as 'fsdp=2,tp=4', a dict of axis sizes, or None"),
    ("mesh", "fsdp", "bad mesh spec 'fsdp': expected NAME=SIZE"),
    ("mesh", "fsdp=3", "mesh {'fsdp': 3} needs 3 devices, but 8"),
])
def test_every_value_is_checked_naming_the_option_the_value_and_what_is_allowed(field, value, allowed, tmp_path):
    message = re.escape(f"{field}={value!r}: {allowed}")
    with pytest.raises(InvalidOptionError, match=message):
        LoadOptions(**{field: value})
    with pytest.raises(InvalidOptionError, match=message):  # before the (missing) source is opened
        otfload.from_pretrained(tmp_path / "no-such-checkpoint", **{field: value})


def test_a_mesh_spec_and_a_dtype_name_are_made_what_the_load_uses():
    options = LoadOptions(mesh="fsdp=2,tp=4", dtype="bf16")
    assert isinstance(options.mesh, Mesh) and dict(options.mesh.shape) == {"fsdp": 2, "tp": 4}
    assert options.dtype == np.dtype("bfloat16")
    assert dict(LoadOptions(mesh={"fsdp": 8}).mesh.shape) == {"fsdp": 8}
    assert LoadOptions(dtype="auto").dtype is None and LoadOptions(dtype=np.float32).dtype == np.float32
    assert resolve_options(LoadOptions(dtype="bf16"), {"dtype": "bfloat16"}).dtype == np.dtype("bfloat16")


@pytest.mark.parametrize(("variable", "value", "field", "want"), [
    ("OTFLOAD_TIMEOUT", "2.5", "timeout", 2.5),
    ("OTFLOAD_RESHARD", "never", "reshard", "never"),
    ("OTFLOAD_DEVICE_HOOKS", "always", "device_hooks", "always"),
    ("OTFLOAD_READ_AHEAD", "0", "read_ahead", False),
    ("OTFLOAD_DIRECT_IO", "1", "direct_io", True),
    ("OTFLOAD_HOST_RING_BYTES", "0", "host_ring_bytes", 0),
    ("OTFLOAD_COLLECTIVE_TIMEOUT", "30", "collective_timeout", 30.0),
])
def test_the_environment_fills_the_fields_left_unset_and_a_keyword_wins(monkeypatch, variable, value, field, want):
    monkeypatch.setenv(variable, value)
    assert getattr(resolve_options(None, {}), field) == want
    assert getattr(LoadOptions(), field) is None  # read when a load resolves its options, not when made
    given = {"timeout": 9.0, "reshard": "always", "device_hooks": "never", "read_ahead": True, "direct_io": False,
             "host_ring_bytes": 7, "collective_timeout": 5.0}[field]
    assert getattr(resolve_options(None, {field: given}), field) == given


@pytest.mark.parametrize(("variable", "value"), [
    ("OTFLOAD_TIMEOUT", "abc"), ("OTFLOAD_TIMEOUT", "-1"), ("OTFLOAD_TIMEOUT", "inf"),
    ("OTFLOAD_RESHARD", "bogus"), ("OTFLOAD_DEVICE_HOOKS", "sometimes"), ("OTFLOAD_READ_AHEAD", "no"),
    ("OTFLOAD_DIRECT_IO", "off"), ("OTFLOAD_HOST_RING_BYTES", "1G"), ("OTFLOAD_COLLECTIVE_TIMEOUT", "nan"),
])
def test_a_bad_environment_value_names_the_variable(monkeypatch, variable, value, tmp_path):
    monkeypatch.setenv(variable, value)
    with pytest.raises(InvalidOptionError, match=re.escape(f"${variable}={value!r}: expected")):
        environment()
    with pytest.raises(InvalidOptionError, match=re.escape(f"${variable}={value!r}")):
        otfload.from_pretrained(tmp_path / "no-such-checkpoint")  # before the source is opened


def test_the_environment_is_read_at_the_front_door_only(monkeypatch, tiny_checkpoints, mesh_2x4):
    """A load under ``OTFLOAD_READ_AHEAD=0`` etc. runs with those values as arguments: what
    execute_plan is given is what the environment said."""
    import otfload.api

    seen = {}
    real = otfload.api.execute_plan

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(otfload.api, "execute_plan", spy)
    for variable, value in (("OTFLOAD_READ_AHEAD", "0"), ("OTFLOAD_DIRECT_IO", "0"), ("OTFLOAD_DEVICE_HOOKS", "never"),
                            ("OTFLOAD_HOST_RING_BYTES", "4096"), ("OTFLOAD_COLLECTIVE_TIMEOUT", "12")):
        monkeypatch.setenv(variable, value)
    otfload.from_pretrained(tiny_checkpoints("llama")[0], mesh=mesh_2x4)
    assert {k: seen[k] for k in ("read_ahead", "direct_io", "device_hooks", "host_ring_bytes", "collective_timeout")} \
        == {"read_ahead": False, "direct_io": False, "device_hooks": "never", "host_ring_bytes": 4096,
            "collective_timeout": 12.0}
