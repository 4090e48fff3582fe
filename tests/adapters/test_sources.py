"""Adapters come from any source a checkpoint can: a local directory or ``Path``, a ``file://`` URL, a
Hub repo (``org/name``, ``org/name@revision``; the real Hub protocol of the local test server), a
``Source`` object — and a location holding only an adapter loads its ``base_model_name_or_path``."""

from __future__ import annotations

import shutil

import pytest

import otfload
from otfload.errors import AdapterError
from otfload.sources import open_source
from tests.adapters.support import peft_logits, set_config
from tests.helpers import jax_logits, max_rel_diff, token_ids

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def llama_adapter(peft_adapters):
    return peft_adapters("llama_patterns")


def check(model, torch_model, adapter) -> None:
    ids = token_ids()
    diff = max_rel_diff(jax_logits(model, ids), peft_logits(torch_model, [adapter], ids))
    assert diff <= TOLERANCE, diff


def test_hub_adapter_on_a_local_base(llama_adapter, hub, tmp_path, mesh_2x4):
    path, torch_model, (adapter,) = llama_adapter
    hub.add_repo("org/tiny-lora", adapter)
    options = dict(endpoint=hub.url, cache_dir=tmp_path / "hf")
    for spec in ("org/tiny-lora", "org/tiny-lora@main"):
        model, report = otfload.from_pretrained(path, adapter=spec, mesh=mesh_2x4, return_report=True, **options)
        check(model, torch_model, adapter)
        assert "hub:org/tiny-lora@main" in report.source
    assert hub.requests("GET", "adapter_model.safetensors")  # the factors came over the Hub protocol


def test_hub_adapter_names_its_base(llama_adapter, hub, tmp_path, mesh_2x4):
    path, torch_model, (adapter,) = llama_adapter
    hub.add_repo("org/tiny-base", path)
    named = set_config(shutil.copytree(adapter, tmp_path / "named"), base_model_name_or_path="org/tiny-base")
    hub.add_repo("org/tiny-lora-named", named)
    model, report = otfload.from_pretrained("org/tiny-lora-named", mesh=mesh_2x4, endpoint=hub.url,
                                            cache_dir=tmp_path / "hf", return_report=True)
    check(model, torch_model, adapter)
    at = f" at {hub.url}"
    assert report.source == f"hub:org/tiny-base@main{at} + adapter hub:org/tiny-lora-named@main{at}"


def test_local_adapter_names_its_base_and_other_location_kinds(llama_adapter, tmp_path, mesh_2x4, closing):
    path, torch_model, (adapter,) = llama_adapter
    named = set_config(shutil.copytree(adapter, tmp_path / "named"), base_model_name_or_path=str(path))
    check(otfload.from_pretrained(named, mesh=mesh_2x4), torch_model, adapter)
    check(otfload.from_pretrained(str(path), adapter=adapter.as_uri(), mesh=mesh_2x4), torch_model, adapter)
    base, lora = closing(open_source(path)), closing(open_source(adapter))
    for _ in range(2):  # sources the caller passes in are not closed by the load
        check(otfload.from_pretrained(base, adapter=[lora], mesh=mesh_2x4), torch_model, adapter)


def test_adapter_only_location_without_base_name_is_an_error(llama_adapter, tmp_path):
    _, _, (adapter,) = llama_adapter
    with pytest.raises(AdapterError, match="base_model_name_or_path"):
        otfload.plan_model(adapter)


def test_merge_adapter_false_and_bad_adapter_arguments(llama_adapter):
    path, _, (adapter,) = llama_adapter
    with pytest.raises(AdapterError, match="merge_adapter=False"):  # kept factors: one adapter at a time
        otfload.from_pretrained(path, adapter=[adapter, adapter], merge_adapter=False)
    with pytest.raises(TypeError, match="adapter="):
        otfload.plan_model(path, adapter=3)
    with pytest.raises(AdapterError, match="no adapter_config.json"):
        otfload.plan_model(path, adapter=path)


def test_combined_source_routes_every_call_and_closes_only_its_own(llama_adapter):
    from otfload.adapters.source import CombinedSource, adapter_file
    from otfload.sources import RangeRead

    path, _, (adapter,) = llama_adapter
    base, lora = open_source(path), open_source(adapter)
    combined = CombinedSource(base, [lora], owned=[lora])
    name = adapter_file(0, "adapter_model.safetensors")
    assert set(combined.list_files()) == set(base.list_files()) | {adapter_file(0, f) for f in lora.list_files()}
    assert combined.size(name) == (adapter / "adapter_model.safetensors").stat().st_size
    first, second = bytearray(16), bytearray(16)
    combined.read_many([RangeRead(name, 8, memoryview(first)), RangeRead("config.json", 0, memoryview(second))])
    assert bytes(first) == (adapter / "adapter_model.safetensors").read_bytes()[8:24]
    assert bytes(second) == (path / "config.json").read_bytes()[:16]
    assert combined.mapped(name) is not None  # local adapters are memory-mapped like local checkpoints
    assert combined.use_mmap and combined.page_granular  # source-wide properties are the base's
    combined.close()
    assert lora.open_files == 0 and base.open_files > 0
    base.close()
