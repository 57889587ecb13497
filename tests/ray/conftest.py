"""One local Ray instance shared by the runtime tests (start-up costs ~5 s; pay it once).

It is a `ray.cluster_utils.Cluster` head on ports of its own ([Note: one dashboard-agent port per Ray]
in testkit/local_ray.py), so a `rayzero run` subprocess starting its own Ray meanwhile does not wait
for the fixed agent port. A test that needs another cluster (`Cluster` with fake nodes, a Ray started
with other environment variables) calls `ray.shutdown()`: that only disconnects this process, the
shared head keeps running, and the next test that asks for `local_ray` connects again (~1 s instead of
a new start-up).
"""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def _session_cluster():
    ray = pytest.importorskip("ray")
    from testkit.local_ray import start_cluster

    # 4 logical CPUs: 2 workers x 1 CPU plus room for Ray Data's tasks.
    cluster = start_cluster(num_cpus=4)
    yield cluster
    if ray.is_initialized():
        ray.shutdown()
    cluster.shutdown()


@pytest.fixture
def local_ray(_session_cluster):
    """The shared local Ray, this process connected to it."""
    import ray

    if not ray.is_initialized():
        ray.init(address=_session_cluster.address, logging_level="WARNING")
    return ray
