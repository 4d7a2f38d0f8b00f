"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture
def client(fleet):
    """An HTTP client of the module's running fleet (each module defines its own ``fleet``)."""
    with fleet.client() as c:
        yield c


@pytest.fixture(scope="session")
def valkey_cluster(tmp_path_factory):
    """A real Valkey Cluster (3 primaries + 3 replicas, testing/cluster.py) for the session; fleets
    on it keep RQ on the machine's Redis (``redis_url``) and their keys under their own prefix."""
    from testing.cluster import ValkeyCluster

    with ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster")) as cluster:
        yield cluster
