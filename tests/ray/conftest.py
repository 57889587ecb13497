"""One local Ray instance shared by the runtime tests (start-up costs ~5 s; pay it once)."""
from __future__ import annotations

import pytest


def _start(ray) -> None:
    # 4 logical CPUs: 2 workers x 1 CPU plus room for Ray Data's tasks.
    # address="local": a new Ray of our own even when another one (a `ray start` head) runs on this machine
    ray.init(address="local", num_cpus=4, include_dashboard=False, logging_level="WARNING")


@pytest.fixture(scope="session")
def _session_ray():
    ray = pytest.importorskip("ray")
    started = not ray.is_initialized()
    if started:
        _start(ray)
    yield ray
    if started and ray.is_initialized():
        ray.shutdown()


@pytest.fixture
def local_ray(_session_ray):
    """The shared local Ray; started again if a test in between shut it down (e.g. a Cluster test)."""
    if not _session_ray.is_initialized():
        _start(_session_ray)
    return _session_ray
