"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def client(fleet):
    """An HTTP client of the module's running fleet (each module defines its own ``fleet``)."""
    with fleet.client() as c:
        yield c
