"""One local Ray instance shared by the runtime tests (start-up costs ~5 s; pay it once)."""
from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def local_ray():
    """A local Ray with 4 logical CPUs: 2 workers x 1 CPU plus room for Ray Data's tasks."""
    ray = pytest.importorskip("ray")
    started = False
    if not ray.is_initialized():
        ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")
        started = True
    yield ray
    if started:
        ray.shutdown()
