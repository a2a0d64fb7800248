"""Fixtures shared by the vmem tests."""

from __future__ import annotations

import pytest

from vmkv.vmem.options import LAYOUTS


@pytest.fixture(params=LAYOUTS)
def layout(request) -> str:
    """Each virtual layout of the vmem backend in turn (``megacache``, ``per_layer``)."""
    return request.param
