"""One process, remote sources: a model loaded from the Hub or gs:// equals the one loaded from disk."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import otfload
from otfload.cache import wrap_with_cache
from otfload.sources import open_source
from tests.helpers import token_ids
from tests.servers.gcs_server import GcsServer
from tests.servers.hub_server import HubServer


def logits(model) -> np.ndarray:
    return np.asarray(jax.jit(lambda m, x: m(x))(model, jnp.asarray(token_ids())))


@pytest.fixture(scope="module")
def local_logits(llama, mesh_2x4) -> np.ndarray:
    return logits(otfload.from_pretrained(llama, mesh=mesh_2x4))


@pytest.mark.parametrize("cache", [None, "shard-cache"])
def test_hub_load_equals_local_load(
    hub: HubServer, llama_repo, local_logits, mesh_2x4, tmp_path, fast_retry, cache, closing
):
    source = open_source(llama_repo, endpoint=hub.url, cache_dir=tmp_path / "hf", retry=fast_retry)
    source = closing(wrap_with_cache(source, cache and tmp_path / cache))
    model, report = otfload.from_pretrained(source, mesh=mesh_2x4, return_report=True)
    np.testing.assert_array_equal(logits(model), local_logits)
    ranged = [r for r in hub.requests("GET", "/resolve/") if not r.range.startswith("bytes=0-")]
    assert bool(ranged) == (cache is None)  # direct: header and tensor ranges; cached: whole files only
    assert report.bytes_read >= report.bytes_planned


def test_gs_load_equals_local_load(gcs_server: GcsServer, llama_bucket, local_logits, mesh_2x4, fast_retry, closing):
    source = closing(open_source(llama_bucket, storage_options=gcs_server.storage_options, retry=fast_retry))
    model = otfload.from_pretrained(source, mesh=mesh_2x4)
    np.testing.assert_array_equal(logits(model), local_logits)


def test_token_never_reaches_report_logs_or_reprs(
    hub: HubServer, llama_repo, mesh_2x4, tmp_path, fast_retry, caplog, closing
):
    secret = "hf_SECRET_token_0123456789"
    hub.token = secret
    try:
        with caplog.at_level("DEBUG"):
            source = closing(open_source(
                llama_repo, endpoint=hub.url, token=secret, cache_dir=tmp_path / "hf", retry=fast_retry
            ))
            model, report = otfload.from_pretrained(source, mesh=mesh_2x4, return_report=True)
    finally:
        hub.token = None
    assert report.bytes_read > 0
    for text in (report.summary(), repr(report), repr(source), source.description, caplog.text):
        assert secret not in text
