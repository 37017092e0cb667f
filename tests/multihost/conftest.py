"""Fixtures of the multi-host tests: two hosts on this machine (network namespaces + sshd),
skipped with the reason where namespaces cannot be created."""
from __future__ import annotations

import pytest

from tests.multihost.netns import NetnsCluster, unavailable_reason


@pytest.fixture(scope="session")
def netns_hosts(tmp_path_factory):
    reason = unavailable_reason()
    if reason:
        pytest.skip(reason)
    cluster = NetnsCluster(2, tmp_path_factory.mktemp("netns"))
    try:
        yield cluster.create()
    finally:
        cluster.destroy()
