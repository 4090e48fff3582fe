"""Session-scoped pytest fixtures for the test servers; import them from a ``conftest.py``.

``hub_server`` / ``gcs_server`` / ``s3_server`` run for the whole session; ``hub`` hands a test the Hub server
running, with an empty request log and no faults (tests may stop it: the next one restarts it).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from .gcs_server import GcsServer
from .hub_server import HubServer
from .s3_server import S3Server


@pytest.fixture(scope="session")
def hub_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HubServer]:
    """A Hub-protocol server over an initially empty root; add repos with ``add_repo``."""
    with HubServer(tmp_path_factory.mktemp("hub-root")) as server:
        yield server


@pytest.fixture
def hub(hub_server: HubServer) -> Iterator[HubServer]:
    """The session Hub server, running, with the log cleared and faults off."""
    if not hub_server.running:
        hub_server.start()
    hub_server.reset()
    yield hub_server
    hub_server.reset()


@pytest.fixture(scope="session")
def gcs_server() -> Iterator[GcsServer]:
    """The real fake-gcs-server; upload with ``upload_dir``."""
    with GcsServer() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1; upload with ``upload_dir``."""
    with S3Server() as server:
        yield server
