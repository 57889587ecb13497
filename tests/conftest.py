"""Tier markers follow the directory: tests/unit -> unit, tests/dist -> dist, and so on.

[Note: file order under xdist]
`make test` runs the files on pytest-xdist workers (`--dist loadfile --no-loadscope-reorder`: each
file whole on one worker, handed out in collection order). The workers collect tests/ray first (its
files run for minutes: Ray clusters, restarts, a chaos soak), then tests/dist (spawned gloo groups),
then tests/k8s, then the rest (unit, fuzz: seconds each). A serial run keeps the directory order.

Two lanes (`pytest_xdist_make_scheduler` below). Worker gw0 takes the k8s tier first, then the Ray
files in order; the other workers take the CPU-bound files first (dist, then unit and fuzz), then
Ray files; each lane goes on with whatever is left once its own kinds are handed out. A Ray file
leaves a core idle for much of its time (workers starting, restarts, backoffs, hang timeouts), and
the k8s tier is mostly waiting on the operator's passes: with both workers on Ray files a quarter of
the two cores was idle for the run's first minutes, and the k8s tier beside a Ray file left a third
idle (sampled from /proc/stat, 2026-11-27), while the CPU-bound files later shared the two cores
with each other. Beside a waiting file, a CPU-bound file takes the idle core.

The k8s tier is one unit, not a unit per file: its files share one apiserver, etcd and operator
(tests/k8s/conftest.py), started once and stopped after its last test. It is not started beside the
chaos soak (it once was, and a node the soak brought back missed Ray's 30 s start-up bound, one full
run of two; bench/chaos_world.py now tries such a node twice): on gw0 the soak starts after it. Its
apiserver restart gives a port up for a moment, so that port comes from outside the ranges anything
else picks from (rayzero.ports.server_port).
"""
from __future__ import annotations

import pathlib

import pytest

_TIERS = ("unit", "dist", "ray", "k8s", "gpu")
_LONGEST_FIRST = ("ray", "dist", "k8s")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        for tier in _TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike, so collections match
        rank = {f"tests/{tier}/": index for index, tier in enumerate(_LONGEST_FIRST)}
        # stable: each file's tests stay together and in order
        items.sort(key=lambda item: next((index for prefix, index in rank.items() if item.nodeid.startswith(prefix)),
                                         len(rank)))


@pytest.fixture
def small_disk(tmp_path):
    """A real, nearly empty small filesystem mounted for one test, so a full disk is one write away:
    a loop-mounted 16 MiB ext4 image (O_DIRECT works on it, as on the disks checkpoints go to), else
    a 16 MiB tmpfs. Needs root and mount(2); skipped, saying what failed, where neither mounts."""
    import shutil
    import subprocess

    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    image = tmp_path / "small-disk.ext4"
    plans = []
    if shutil.which("mkfs.ext4"):
        plans.append(("ext4", [["truncate", "-s", "16M", str(image)],
                               ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)],
                               ["mount", "-o", "loop", str(image), str(mount_point)]]))
    plans.append(("tmpfs", [["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mount_point)]]))
    attempts = []
    for kind, steps in plans:
        failed = None
        for step in steps:
            done = subprocess.run(step, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                failed = f"{' '.join(step)}: {done.stderr.strip() or done.returncode}"
                break
        if failed is None:
            break
        attempts.append(failed)
    else:
        pytest.skip("cannot mount a small filesystem here (needs root and mount): " + "; ".join(attempts))
    try:
        from testkit.small_disk import SmallDisk

        yield SmallDisk(mount_point, kind)
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)


_LANES = (("k8s", "ray", "cpu"), ("cpu", "ray", "k8s"))
"""Each lane's preference over the kinds of files ([Note: file order under xdist]): gw0's, the others'."""


def _kind(scope: str) -> str:
    return "k8s" if scope == "tests/k8s" else "ray" if scope.startswith("tests/ray/") else "cpu"


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` with tests/k8s as one unit, in two lanes ([Note: file order under xdist])."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Lanes(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/k8s" if nodeid.startswith("tests/k8s/") else super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            lane = _LANES[0] if node.workerinput["workerid"] == "gw0" else _LANES[1]
            kinds = [_kind(scope) for scope in self.workqueue]
            best = min(kinds, key=lane.index)
            self.workqueue.move_to_end(list(self.workqueue)[kinds.index(best)], last=False)  # handed out next
            super()._assign_work_unit(node)

    return _Lanes(config, log)
