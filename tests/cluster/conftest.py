"""Fixtures for tests/cluster: a real cluster of two ssh hosts on this machine (root)."""

import pytest

from hvd_balance.tools import netns_cluster
from support.cluster import skip_reason


@pytest.fixture(scope="session")
def cluster_ready():
    """Skips with the reason when this machine cannot make a cluster."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(cluster_ready):
    """hostA and hostB, unshaped, torn down after the module (and checked to be gone)."""
    with netns_cluster.NetnsCluster(["hostA", "hostB"]) as c:
        yield c
    assert netns_cluster.leftovers(c.run_id) == []
