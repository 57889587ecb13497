"""Hypothesis profiles for the fuzz targets (issue 22 section 4).

`ci` (the default, part of every `pytest` run): a bounded, derandomized number of examples per
target, about a minute for all of tests/fuzz on a 2-core machine, and no example database, so CI is
reproducible. `fuzz` (`make fuzz`, or RAYZERO_FUZZ_PROFILE=fuzz): many more random examples, with
the database in .hypothesis/ so a failure found once is replayed first next time. Every target
asserts one property: the input is accepted, or refused with a RayZeroError (a gRPC status other
than UNKNOWN/INTERNAL for the service) that names the field or file; never another exception type,
a hang, a partial write or a deleted file. `--hypothesis-show-statistics` prints examples per target.
"""
from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, settings

PROFILE_ENV = "RAYZERO_FUZZ_PROFILE"

_COMMON = {"suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.function_scoped_fixture], "deadline": None}
settings.register_profile("ci", max_examples=40, derandomize=True, database=None, print_blob=True, **_COMMON)
settings.register_profile("fuzz", max_examples=2000, print_blob=True, **_COMMON)
settings.load_profile(os.environ.get(PROFILE_ENV, "ci"))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "fuzz" in item.path.parts:
            item.add_marker(pytest.mark.unit)
            item.add_marker(pytest.mark.fuzz)
