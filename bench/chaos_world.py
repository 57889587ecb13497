"""What the chaos soak runs on and reads: the seeded fault schedule, a local 3-node Ray cluster
with a small node-local disk, the loops' trail, and the checks that no committed checkpoint was lost.
(bench/chaos.py drives the soak; bench/chaos_loop.py is the training loop.)
"""
from __future__ import annotations

import contextlib
import itertools
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

# The fault kinds, in the order; the first six are the regression test's.
KINDS = ("kill", "hang", "node", "sigterm", "enospc", "corrupt", "driver", "scale", "stop")
FIRST_SIX = KINDS[:6]
RAY_TRAIN_SKIPS = {
    "enospc": "fills rayzero's own node-local tier; Ray Train v2 has no node-local tier (its checkpoints "
              "go to storage_path only)",
    "scale": "Ray Train v2 has no call that resizes a running run",
}


@dataclass(frozen=True)
class Fault:
    """One scheduled fault; the victim is chosen at injection time from what is there, by `pick`."""

    index: int
    kind: str
    gap_s: float
    """Seconds after the previous fault (never before training resumed from it)."""
    pick: float
    """In [0, 1): which rank (or node, or file) among the current ones."""
    hold_s: float
    """How long a removed node stays away, or the disk stays full."""


def schedule(seed: int, count: int, kinds: tuple[str, ...], gap: tuple[float, float],
             hold: tuple[float, float]) -> list[Fault]:
    """`count` faults: the first len(kinds) are every kind once in a seeded order (so a short run
    sees each kind), the rest drawn uniformly; gaps and hold times drawn uniformly from their ranges."""
    rng = random.Random(seed)
    order = rng.sample(list(kinds), len(kinds))
    order += [rng.choice(kinds) for _ in range(max(0, count - len(order)))]
    return [Fault(index, kind, round(rng.uniform(*gap), 2), rng.random(), round(rng.uniform(*hold), 2))
            for index, kind in enumerate(order[:count])]


# ---- the disk the node-local checkpoints live on -------------------------------------------------

class SmallDisk:
    """A loop-mounted ext4 image holding every node's node-local directory, filled to make saves
    fail with ENOSPC (as tests/conftest.py's `small_disk` fixture does for the tests)."""

    def __init__(self, mount_point: Path, image: Path) -> None:
        self.path, self._image = mount_point, image
        self._filler = mount_point / "filler.bin"

    @classmethod
    def mount(cls, mount_point: Path, size_mb: int) -> SmallDisk | str:
        """The mounted disk, or why it could not be mounted (needs root and mount(2))."""
        mount_point.mkdir(parents=True, exist_ok=True)
        image = mount_point.with_suffix(".ext4")
        for command in (["truncate", "-s", f"{size_mb}M", str(image)], ["mkfs.ext4", "-q", "-F", "-m", "0", str(image)],
                        ["mount", "-o", "loop", str(image), str(mount_point)]):
            if not shutil.which(command[0]):
                return f"{command[0]} is not installed"
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode != 0:
                return f"{' '.join(command)}: {done.stderr.strip() or done.returncode}"
        return cls(mount_point, image)

    def free_bytes(self) -> int:
        stats = os.statvfs(self.path)
        return stats.f_bavail * stats.f_frsize

    def fill(self, leave_bytes: int = 0) -> None:
        """Take every free byte but about `leave_bytes` (again and again in the soak: retention may have
        freed some)."""
        with open(self._filler, "ab") as out:
            while self.free_bytes() > leave_bytes:
                try:
                    out.write(b"\0" * max(4096, min(1 << 20, self.free_bytes() - leave_bytes)))
                    out.flush()
                    os.fsync(out.fileno())
                except OSError:
                    break

    def release(self) -> None:
        self._filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        subprocess.run(["umount", "-l", str(self.path)], capture_output=True, check=False)
        self._image.unlink(missing_ok=True)


# ---- the cluster ---------------------------------------------------------------------------------

@contextlib.contextmanager
def local_cluster(node_local_root: Path, workers: int = 3, dashboard: bool = False) -> Iterator[object]:
    """A head with no CPU (drivers and controllers live there: losing a worker node never takes them)
    and `workers` 1-CPU nodes whose workers keep node-local checkpoints under `node_local_root`.
    `dashboard`: Ray Train v2 needs it: its PlacementGroupCleaner asks the state API whether the
    controller lives, and without an answer never frees a killed driver's placement group, so the
    rerun waits forever for "ready resources for 0 workers"."""
    from ray.cluster_utils import Cluster

    from rayzero.ports import server_port

    saved = {key: os.environ.get(key) for key in ("RAYZERO_NODE_LOCAL_DIR", "PYTHONPATH")}
    os.environ["RAYZERO_NODE_LOCAL_DIR"] = str(node_local_root)  # inherited by the nodes' workers
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(BENCH), str(REPO), saved["PYTHONPATH"]]))
    # the head's agent on a port the kernel picks: another Ray on this machine may hold Ray's fixed 52365
    head = {"num_cpus": 0, "include_dashboard": dashboard, "dashboard_agent_listen_port": 0}
    if dashboard:  # other Ray instances on this machine may hold the default 8265
        head.update(dashboard_host="127.0.0.1", dashboard_port=server_port())
    cluster = Cluster()
    try:
        add_node_retrying(cluster, "the head", **head)
        for _ in range(workers):
            add_worker_node(cluster)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


NODE_START_TRIES = 3
"""Starts of a node while it misses Ray's start-up bounds on a loaded machine ([Note: Ray's start-up
bounds] in rayzero/driver/startup.py): seen for a joining node of the soak's cluster (always a returning
node; about one full test run in four) and for a test's head."""


def add_node_retrying(cluster, who: str, tag: str = "[chaos]", **node_args) -> object:
    """`cluster.add_node(**node_args)`, the failed node stopped and a fresh one started while it misses
    Ray's start-up bounds (`who` names it in the lines that say so). Used by the tests' clusters too
    (tests/testkit)."""
    from rayzero.driver.startup import start_retrying

    return start_retrying(lambda: cluster.add_node(**node_args), who, NODE_START_TRIES, tag=tag)


def add_worker_node(cluster) -> object:
    """A 1-CPU worker node (Ray gives its dashboard agent a port the kernel picks: a joining node's
    agent never contends for the head's)."""
    return add_node_retrying(cluster, "a node", num_cpus=1)


# ---- the loops' trail ------------------------------------------------------------------------------

@dataclass
class Trail:
    """What the loops wrote (bench/chaos_loop.py's module docstring), read incrementally."""

    root: Path
    steps: list[tuple[str, int, float, int]] = field(default_factory=list)  # invocation, step, time, world
    loads: dict[str, int] = field(default_factory=dict)  # invocation -> the step it resumed from
    _offset: int = 0

    def refresh(self) -> None:
        path = self.root / "times.log"
        if path.exists():
            with open(path, "rb") as handle:
                handle.seek(self._offset)
                data = handle.read()
            complete = data[:data.rfind(b"\n") + 1]
            self._offset += len(complete)
            for line in complete.decode().splitlines():
                invocation, step, when, world = line.split()
                self.steps.append((invocation, int(step), float(when), int(world)))
        loads = self.root / "loads.log"
        if loads.exists():
            for line in loads.read_text().splitlines():
                invocation, step = line.split()
                self.loads[invocation] = int(step)

    def invocations(self) -> set[str]:
        return {entry[0] for entry in self.steps}

    @property
    def step(self) -> int:
        return self.steps[-1][1] if self.steps else 0

    @property
    def world(self) -> int:
        return self.steps[-1][3] if self.steps else 0

    def first_step_after(self, moment: float, old: set[str] | None = None, world: int | None = None
                         ) -> tuple[str, int, float, int] | None:
        """The first step after `moment` of an invocation not in `old` (with `world` ranks)."""
        for entry in self.steps:
            if entry[2] > moment and (old is None or entry[0] not in old) and (world is None or entry[3] == world):
                return entry
        return None

    def ranks(self) -> dict[int, tuple[int, str]]:
        """rank -> (pid, node id) of the newest processes, ranks below the current world size."""
        found = {}
        for path in (self.root / "ranks").glob("rank*"):
            rank = int(path.name.removeprefix("rank"))
            parts = path.read_text().split()
            if rank < max(self.world, 1) and len(parts) >= 2 and _alive(int(parts[0])):
                found[rank] = (int(parts[0]), parts[1])
        return found

    def summary(self) -> dict:
        """Kept and redone steps and the clean step time: the outside view of goodput (both systems)."""
        by_invocation: dict[str, list[tuple[int, float]]] = {}
        for invocation, step, when, _ in self.steps:
            by_invocation.setdefault(invocation, []).append((step, when))
        intervals = [b[1] - a[1] for runs in by_invocation.values() for a, b in itertools.pairwise(runs)
                     if b[0] == a[0] + 1]
        final = self.steps[-1][1] if self.steps else 0
        return {"final_step": final, "step_executions": len(self.steps),
                "steps_redone": max(0, len(self.steps) - final),
                "invocations": len(by_invocation),
                "median_step_s": round(statistics.median(intervals), 4) if intervals else None}


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie is gone for our purposes
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


# ---- committed checkpoints, checked from the disks -----------------------------------------------

def tag_dirs(node_local_root: Path, run_name: str) -> dict[int, list[Path]]:
    """step -> the committed tag directories (manifest present) on the nodes' disks that exist."""
    found: dict[int, list[Path]] = {}
    for manifest in node_local_root.glob(f"*/checkpoints/{run_name}/global_step*/manifest.json"):
        step = int(manifest.parent.name.removeprefix("global_step"))
        found.setdefault(step, []).append(manifest.parent)
    return found


def unloadable_files(directories: list[Path], node_local_root: Path, run_name: str) -> list[str]:
    """The files of a committed checkpoint with no copy whose checksum matches its manifest, on any
    node's disk; [] when the loader can assemble it ([Note: choosing what to load])."""
    from rayzero.checkpoint.manifest import read_manifest
    from rayzero.checkpoint.shard_file import file_checksum

    manifest = None
    for directory in directories:
        manifest = manifest or read_manifest(str(directory))
    if manifest is None:
        return ["manifest.json"]
    tag = directories[0].name
    copies = list(node_local_root.glob(f"*/checkpoints/{run_name}/{tag}"))
    missing = []
    for name, entry in manifest.files.items():
        good = False
        for directory in copies:
            path = directory / name
            try:
                good = path.stat().st_size == entry.size and file_checksum(str(path)) == entry.checksum
            except OSError:
                good = False
            if good:
                break
        if not good:
            missing.append(name)
    return missing


def flip_bytes(path: Path, count: int = 16) -> None:
    """Corrupt a file in place: invert `count` bytes in its middle (its data, not its header)."""
    with open(path, "r+b") as handle:
        size = handle.seek(0, os.SEEK_END)
        handle.seek(max(0, size // 2))
        data = bytearray(handle.read(count))
        handle.seek(max(0, size // 2))
        handle.write(bytes(byte ^ 0xFF for byte in data))
        handle.flush()
        os.fsync(handle.fileno())


def scratch_root(base: str | None) -> Path:
    return Path(tempfile.mkdtemp(prefix="rayzero-chaos-", dir=base))


def python() -> str:
    return sys.executable
