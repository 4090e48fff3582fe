"""The Hub's range GETs over urllib3 (otfload/sources/http_body.py), against real local servers:
redirects to another host, proxies from the environment, kept-alive connections, unread bodies."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import urllib3

from otfload.sources import http_body
from otfload.sources.base import read_bytes
from otfload.sources.hub import HubSource
from tests.servers.hub_server import HubServer
from tests.sources.test_hub import REPO, SECRET, SHARD  # the same tiny repo as the Hub source's own tests


@pytest.fixture(scope="module")
def repo(hub_server: HubServer, checkpoint: Path) -> str:
    return hub_server.add_repo(REPO, checkpoint)


@pytest.fixture
def second_server(tmp_path: Path, checkpoint: Path) -> Iterator[HubServer]:
    """Another server (another host:port) holding the same repo: a CDN, or a proxy in front of the Hub."""
    with HubServer(tmp_path / "second-root") as server:
        server.add_repo(REPO, checkpoint)
        yield server


@pytest.fixture
def no_proxy_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in ("http_proxy", "https_proxy", "all_proxy", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.upper(), raising=False)
    return monkeypatch


def _open(hub: HubServer, tmp_path: Path, fast_retry, **kw) -> HubSource:
    return HubSource(REPO, endpoint=hub.url, cache_dir=tmp_path / "hf-cache", retry=fast_retry, **kw)


def test_a_redirect_to_another_host_is_followed_without_the_token(
    hub, repo, second_server, tmp_path, fast_retry, checkpoint, no_proxy_env
):
    hub.token = SECRET
    try:
        src = _open(hub, tmp_path, fast_retry, token=SECRET)
        hub.faults.redirect_to = second_server.url
        got = read_bytes(src, SHARD, 1000, 50_000)
    finally:
        hub.token = None
    assert got == (checkpoint / SHARD).read_bytes()[1000:51_000]
    at_hub = hub.requests("GET", "/resolve/")
    at_cdn = second_server.requests("GET", "/resolve/")
    assert at_hub and at_cdn
    assert all(r.authorization == f"Bearer {SECRET}" for r in at_hub)
    assert all(r.authorization is None for r in at_cdn)  # the token stays with the Hub's host


def test_range_reads_go_through_the_environments_proxy(
    hub, repo, second_server, tmp_path, fast_retry, checkpoint, no_proxy_env
):
    src = _open(hub, tmp_path, fast_retry)  # revision metadata straight from the Hub
    hub.reset()
    no_proxy_env.setenv("HTTP_PROXY", second_server.url)
    got = read_bytes(src, SHARD, 0, 4096)
    assert got == (checkpoint / SHARD).read_bytes()[:4096]
    assert not hub.requests("GET", "/resolve/")
    assert second_server.requests("GET", f"/{REPO}/resolve/")  # the proxy got the absolute-form request


def test_no_proxy_bypasses_the_proxy(hub, repo, second_server, tmp_path, fast_retry, no_proxy_env):
    src = _open(hub, tmp_path, fast_retry)
    no_proxy_env.setenv("HTTP_PROXY", second_server.url)
    no_proxy_env.setenv("NO_PROXY", "127.0.0.1")
    read_bytes(src, SHARD, 0, 4096)
    assert hub.requests("GET", "/resolve/") and not second_server.requests("GET", "/resolve/")


def test_connections_are_kept_alive_until_the_source_closes(hub, repo, tmp_path, fast_retry, no_proxy_env):
    src = _open(hub, tmp_path, fast_retry)
    hub.reset()
    for offset in range(0, 40 * 1000, 1000):
        read_bytes(src, SHARD, offset, 1000)
    assert len(hub.requests("GET", "/resolve/")) == 40
    assert hub.connections == 1  # one connection served all 40 (the metadata's is huggingface_hub's)
    before = hub.open_connections()
    src.close()
    deadline = time.monotonic() + 5
    while hub.open_connections() == before and time.monotonic() < deadline:  # the server sees the close
        time.sleep(0.01)
    assert hub.open_connections() == before - 1


def test_a_body_left_unread_does_not_reach_the_next_answer(hub, repo, tmp_path, fast_retry, checkpoint, no_proxy_env):
    """A 200 with the whole file is cut once the wanted bytes are in; its connection is closed, not
    reused with the rest of that body still on it."""
    src = _open(hub, tmp_path, fast_retry)
    data = (checkpoint / SHARD).read_bytes()
    hub.faults.range_fault, hub.faults.range_fault_next = "full", 1
    assert read_bytes(src, SHARD, 10, 100) == data[10:110]
    assert read_bytes(src, SHARD, 5000, 100) == data[5000:5100]


def test_proxies_and_certificates_come_from_the_environment(no_proxy_env, tmp_path):
    connections = http_body.Connections()
    assert type(connections.pool_for("http://example.org/x")) is urllib3.PoolManager
    no_proxy_env.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")
    pool = connections.pool_for("https://example.org/x")
    assert isinstance(pool, urllib3.ProxyManager) and pool.proxy.host == "proxy.invalid"
    assert type(connections.pool_for("http://example.org/x")) is urllib3.PoolManager  # HTTPS_PROXY only
    bundle = tmp_path / "ca.pem"
    no_proxy_env.delenv("SSL_CERT_DIR", raising=False)
    no_proxy_env.setenv("SSL_CERT_FILE", str(bundle))
    assert http_body._ca_options() == (str(bundle), None)
    no_proxy_env.delenv("SSL_CERT_FILE")
    certifi_bundle, _ = http_body._ca_options()
    assert certifi_bundle is not None and Path(certifi_bundle).is_file()


def test_error_bodies_are_read_only_so_far(hub, repo, tmp_path, fast_retry, no_proxy_env):
    url = f"{hub.url}/{REPO}/resolve/main/missing.bin"
    connections = http_body.Connections()
    with connections.get(url, {}, idle_s=5.0) as r:
        assert r.status == 404
        body = http_body.error_body(r)
    connections.close()
    assert b"does not exist" in body and len(body) <= http_body.ERROR_BODY_BYTES


def test_bodies_go_straight_into_the_buffer_and_a_short_one_is_urllib3s_protocol_error(
    hub, repo, checkpoint, no_proxy_env
):
    """body_reader fills the caller's buffer from http.client (no bytes object per piece), the
    connection goes back to the pool once the body is read, and a body cut before its Content-Length
    fails as urllib3's own read fails (what the retry policy and the stall detection expect)."""
    url = f"{hub.url}/{REPO}/resolve/main/{SHARD}"
    data = (checkpoint / SHARD).read_bytes()
    connections = http_body.Connections()

    def read_all(headers: dict[str, str], size: int) -> bytearray:
        out, done = bytearray(size), 0
        with connections.get(url, headers, idle_s=5.0) as r:
            read = http_body.body_reader(r)
            assert read != r.readinto  # http.client's, not urllib3's copy
            while done < size and (got := read(memoryview(out)[done:])):
                done += got
            assert read(memoryview(bytearray(1))) == 0  # the body's end
        return out

    hub.reset()
    assert read_all({"Range": "bytes=100-4099"}, 4000) == data[100:4100]
    assert read_all({"Range": "bytes=0-99"}, 100) == data[:100]
    assert hub.connections == 1  # released to the pool after each body, not closed
    hub.faults.truncate_next = 1
    with pytest.raises(urllib3.exceptions.ProtocolError, match="IncompleteRead"):
        read_all({"Range": "bytes=0-3999"}, 4000)
    connections.close()
