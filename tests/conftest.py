"""Tier markers follow the directory: tests/unit -> unit, tests/dist -> dist, and so on.

[Note: file order under xdist]
`make test` runs the files on pytest-xdist workers (`--dist loadfile --no-loadscope-reorder`: each
file whole on one worker, handed out in collection order). The workers collect tests/ray first (its
files run for minutes: Ray clusters, restarts, a chaos soak), then tests/dist (spawned gloo groups),
then tests/k8s, then the rest (unit, fuzz: seconds each). A serial run keeps the directory order.

Two lanes (`pytest_xdist_make_scheduler` below): worker gw0 takes the Ray files first, in that order;
the other workers take the rest first (dist, k8s, unit), and each lane goes on with the other's files
once its own are handed out. A Ray file leaves a core idle for much of its time (workers starting,
restarts, backoffs, hang timeouts): with both workers on Ray files, a quarter of the two cores was
idle for the first minutes of the run (sampled from /proc/stat, 2026-11-27), while the CPU-bound
dist and unit files later shared the two cores with each other. Beside a Ray file, a CPU-bound file
takes the idle core. Measured in full `make test` runs on the 2-core machine (2026-11-27, pytest's
wall time; the same commits differ by up to ~50 s between runs there): one queue for both workers
699 s and 753 s; two lanes 652 s and 654 s, with 5-6% fewer CPU-seconds (the same processes, less
contended). The k8s tier first in gw0's lane instead (beside the CPU lane) took 675 s: no gain.
Three workers (gw1 and gw2 in the second lane), the slowest Ray files handed out first
(`_SLOW_RAY_FILES`) so that the lanes end close together. Two runs back to back on the same commits
(2026-11-27): two workers 700 s, the cores busy 87.7% of the time (172 idle core-seconds); three
workers 622 s, busy 96.1% (47 idle), for the same ~1,220 busy core-seconds. Other runs of three:
688 s and 746 s (in that one every tier ran ~8% slower: the shared machine); three in directory order
712 s; four 727 s. A third worker fills the time in which the Ray files wait on their own
processes; a fourth only contends. Lowering the CPU-bound tiers' priority (nice 10) instead moved
~45 s from the Ray tier to the dist tier and gained nothing (Ray's workers ran at nice 15 then:
[Note: Ray's workers at the tests' priority]).

The k8s tier is one unit, not a unit per file: its files share one apiserver, etcd and operator
(tests/k8s/conftest.py), started once and stopped after its last test. Most of its time is waiting
on the operator's passes, so it overlaps other work. It does not go first: handed out first it
started its apiserver, etcd, operator and a real run's Ray while the chaos soak started its 3-node
cluster, and a node the soak brought back missed Ray's 30 s start-up bound (one full run of two;
bench/chaos_world.py now tries such a node up to three times: add_node_retrying). Its apiserver
restart gives a port up for a moment, so that port comes from outside the ranges anything else
picks from (rayzero.ports.server_port).

The figures above are from 2026-11-27 (1,337 tests). By 2026-11-29 the suite had 1,652, and a full run
here took 47 min of pytest: `make test` now leaves out the long tier ([Note: the long tier],
tests/long_tier.py), whose tests carry the `long` mark.
"""
from __future__ import annotations

import os
import pathlib

import pytest

# [Note: Ray's workers at the tests' priority]
# Ray starts its worker processes (every actor: the controller, the train workers, the relays) at
# nice 15 (its `worker_niceness`), the rest of `make test` runs at nice 0. CFS weighs nice 15 at 1/28
# of nice 0, so while the CPU lane's gloo groups kept both cores busy the Ray lane's actors got almost
# none of them: the chaos soak's recoveries took 40-50 s each instead of ~10, a returned node's grow
# back missed its 180 s bound (a local run beside 4-rank dist tests, 2026-11-28), and on CI the soak
# ran past its 840 s limit. The Ray tier's tests have wall-clock bounds (hang detection, Ray's
# start-up, heartbeats) and the CPU lane's do not: the actors run at the same priority as the rest.
# Set before any test starts a Ray node; every raylet, and so every worker, inherits it.
os.environ.setdefault("RAY_worker_niceness", "0")
# A head waits RAY_DASHBOARD_STARTUP_TIMEOUT_S (60 s) for its dashboard process to come up, then fails
# ([Note: Ray's start-up bounds]): on a loaded 2-core machine the test head's dashboard took longer (a
# fresh clone's `make test`, 2026-11-28). It is a wait on the dashboard's published address, not a
# sleep: a longer bound costs nothing when the dashboard is up sooner.
os.environ.setdefault("RAY_DASHBOARD_STARTUP_TIMEOUT_S", "180")
# inductor compiles in a pool of worker processes as wide as the machine, each importing torch: on 2
# shared cores the pool's start cost more than it saved (tests/dist/test_compile.py's one-rank case
# 6 s alone, 90 s in a fresh clone's `make test`); the tests' graphs are small, compiled in-process.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
# [Note: one OpenMP thread per test process]
# Every process a test starts runs one OpenMP thread, as torchrun and Ray give their workers
# (OMP_NUM_THREADS=1; Ray: the actor's CPUs). With OpenMP's default, one thread per core, a team's
# threads spin at each barrier waiting for a thread the scheduler has parked behind another process:
# tests/dist/test_fidelity_bias_correction.py (DeepSpeed's CPU Adam and FusedAdam in its ranks) took
# 328 s beside two busy loops, 51 s with this set (2026-11-29), and sat past its 900 s limit once in a
# full run. `harness.gloo_init`'s torch.set_num_threads(1) did not reach DeepSpeed's kernels' team.
# Read by each process's OpenMP runtime at start: set before anything here imports torch.
os.environ.setdefault("OMP_NUM_THREADS", "1")

_TIERS = ("unit", "dist", "ray", "k8s", "gpu")
_LONGEST_FIRST = ("ray", "dist", "k8s")
# Within the Ray tier, the files that ran longest (tests/ray, 2026-11-27: each 45-130 s beside two other
# files), so that the last files handed out are short ones and the lanes end together.
# (2026-11-29: `make test`'s share of each, beside the CPU lane, 70-240 s; [Note: the long tier] for the rest).
_SLOW_RAY_FILES = ("test_job_submit", "test_first_hour", "test_hf_trainer", "test_fit", "test_faults",
                   "test_multinode_emulated", "test_planned_stop", "test_node_loss", "test_stages", "test_cli",
                   "test_path_new_user", "test_scale_group")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    from tests.long_tier import LONG

    for item in items:
        parts = pathlib.Path(str(item.fspath)).parts
        for tier in _TIERS:
            if tier in parts:
                item.add_marker(getattr(pytest.mark, tier))
        if any(item.nodeid.startswith(prefix) for prefix in LONG):  # [Note: the long tier]
            item.add_marker(pytest.mark.long)
    if hasattr(config, "workerinput"):  # an xdist worker: every worker sorts alike, so collections match
        rank = {f"tests/{tier}/": index for index, tier in enumerate(_LONGEST_FIRST)}
        slow = {f"tests/ray/{name}.py": index for index, name in enumerate(_SLOW_RAY_FILES)}

        def order(item: pytest.Item) -> tuple[int, int]:
            tier = next((index for prefix, index in rank.items() if item.nodeid.startswith(prefix)), len(rank))
            return tier, slow.get(item.nodeid.split("::")[0], len(slow))

        items.sort(key=order)  # stable: each file's tests stay together and in order


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


def pytest_xdist_make_scheduler(config: pytest.Config, log: object) -> object | None:
    """`--dist loadfile` with tests/k8s as one unit, in two lanes ([Note: file order under xdist])."""
    if config.getoption("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class _Lanes(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return "tests/k8s" if nodeid.startswith("tests/k8s/") else super()._split_scope(nodeid)

        def _assign_work_unit(self, node) -> None:
            ray_lane = node.workerinput["workerid"] == "gw0"
            own = next((scope for scope in self.workqueue if scope.startswith("tests/ray/") == ray_lane), None)
            if own is not None:
                self.workqueue.move_to_end(own, last=False)  # the next one handed out
            super()._assign_work_unit(node)

    return _Lanes(config, log)
