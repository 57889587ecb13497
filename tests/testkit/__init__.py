"""Helpers shared by the test tiers, one importable package: `from testkit import harness`.

pyproject.toml's `[tool.pytest.ini_options] pythonpath = ["tests", "."]` puts `tests/` (this package)
and the repository root (`bench`, `scripts`, `tests.data`, `tests.fixtures`) on `sys.path` before any
test is collected, so no test module edits `sys.path` to reach a helper. Processes a test starts see
the same: torch.multiprocessing's spawn children get the parent's `sys.path`; a loop handed to
`rayzero.fit` travels by value with these modules ([Note: shipping the loop]); a subprocess gets
`subprocess_env()`.

- harness: spawn a real gloo group on CPU, the parity model, cases and reference run (tests/dist, tests/gpu)
- elastic_loop, fault_hooks: the deterministic loop of the fault and resize tests, its kill seam (tests/ray)
- control_fake_run: an in-process ControlTarget for the control-plane tests (unit, fuzz, k8s)
- control_driver: a real `rayzero.fit` run served over the control plane, as a script (ray, k8s)
- small_disk: the mounted small filesystem of the `small_disk` fixture (unit, dist)
- k8s_support, kuberay_crds: the operator tests' view of the apiserver, KubeRay's CRDs (k8s)
"""
from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
"""The tests/ directory: what `sys.path` needs for `import testkit`."""
REPOSITORY = TESTS.parent


def subprocess_env(**extra: str) -> dict[str, str]:
    """os.environ for a Python subprocess that imports `testkit`: PYTHONPATH gains tests/, and `extra`."""
    path = [str(TESTS), *(part for part in os.environ.get("PYTHONPATH", "").split(os.pathsep) if part)]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), **extra}
