"""Fixtures shared by the server tests."""

from __future__ import annotations

import pytest

from server_helpers import RunningServer


@pytest.fixture(scope="module", params=["paged", "vmem"])
def server(request, tiny_model_dir):
    """The real two-process server on the tiny model (``RunningServer``), each KV backend in turn, one per
    module; ``test_server.py`` has its own, which also checks the server thread stopped."""
    srv = RunningServer(tiny_model_dir, request.param)
    yield srv
    srv.stop()
