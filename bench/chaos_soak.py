"""One system (rayzero or Ray Train v2) through the seeded fault schedule on a fresh local cluster:
launch the driver, inject each fault, wait for training to resume, check that no committed
checkpoint was lost, finish at a step and compare the weights with the fault-free reference.
(bench/chaos.py is the command; its docstring says what each fault does and how it is measured.)
"""
from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from chaos_faults import Faults
from chaos_world import (
    BENCH,
    FIRST_SIX,
    RAY_TRAIN_SKIPS,
    REPO,
    SmallDisk,
    Trail,
    local_cluster,
    python,
    schedule,
    tag_dirs,
    unloadable_files,
)

KEEP_LAST = 3
COMMIT_WAIT_S = 120.0
"""How long a fault after a restart waits, beyond its gap, for a checkpoint newer than the restart's
resume point (rayzero): rayzero's default FailureConfig ends a run after 3 failures in a row with no
new checkpoint between them (max_failures_without_progress), and on a loaded machine a restart can
take longer than the gap, so back-to-back faults would hit that rule, not the recovery under test
(seen: corrupt, kill and hang each resumed from step 200, and the run ended). A soak's real gaps
(30-90 s) leave room for many checkpoints; the short test soak's do not always."""


@dataclass(frozen=True)
class SoakOptions:
    minutes: float = 30.0
    seed: int = 0
    kinds: tuple[str, ...] = FIRST_SIX
    gap: tuple[float, float] = (30.0, 90.0)
    hold: tuple[float, float] = (10.0, 30.0)
    min_faults: int = 0
    hang_timeout_s: float = 15.0
    settle_s: float = 5.0
    """A fault never comes sooner than this after training resumed from the previous one."""
    sleep_s: float = 0.05
    disk_mb: int = 64
    recovery_timeout_s: float = 300.0


class Soak(Faults):
    """One system, one checkpoint setting ("auto" or a step count the loop saves at)."""

    def __init__(self, system: str, setting: str | int, options: SoakOptions, root: Path) -> None:
        self.system, self.setting, self.options = system, setting, options
        self.root = root / f"{system}-{setting}"
        self.root.mkdir(parents=True)
        self.name = f"chaos-{system}-{setting}"
        self.storage = self.root / "storage"
        self.trail = Trail(self.root / "trail")
        self.trail.root.mkdir()
        self.node_local = self.root / "node-local"
        self.disk: SmallDisk | None = None
        self.disk_problem = ""
        self.cluster = None
        self.driver: subprocess.Popen | None = None
        self.launch = -1
        self.launch_times: list[float] = []
        self.unexpected_exits: list[dict] = []
        self.commits: dict[int, float] = {}  # step -> when a status first listed it committed
        self.lost: list[dict] = []
        self.checks = 0
        self.records: list[dict] = []
        self._client = None
        self._next_poll = 0.0
        self.interval_shown: dict[str, str] = {}  # the newest status's checkpoint interval and its inputs

    # ---- the run ------------------------------------------------------------------------------
    def run(self) -> dict:
        if self.system == "rayzero":
            mounted = SmallDisk.mount(self.node_local, self.options.disk_mb)
            self.disk, self.disk_problem = (mounted, "") if isinstance(mounted, SmallDisk) else (None, mounted)
        self.node_local.mkdir(exist_ok=True)
        try:
            with local_cluster(self.node_local, dashboard=self.system == "ray-train") as cluster:
                self.cluster = cluster
                return self._soak()
        finally:
            if self._client is not None:
                self._client.close()
            if self.driver is not None and self.driver.poll() is None:
                self.driver.kill()
                self.driver.wait()
            if self.disk is not None:
                self.disk.unmount()

    def _soak(self) -> dict:
        options = self.options
        self._start_driver()
        first = self._wait(lambda: self.trail.steps, 600, "the first step")
        began = self.launch_times[0]
        deadline = began + options.minutes * 60
        previous_at = previous_resumed = time.time() if first else began
        resumed_step = None  # the previous fault's resume point, when it restarted the loop
        count = max(options.min_faults, int(options.minutes * 60 / options.gap[0]) + len(options.kinds))
        for fault in schedule(options.seed, count, options.kinds, options.gap, options.hold):
            at = max(previous_at + fault.gap_s, previous_resumed + options.settle_s)
            if at > deadline and len(self.records) >= options.min_faults:
                break
            self._wait(lambda at=at: time.time() >= at, at - time.time() + 600, "the next fault")
            if self.system == "rayzero" and resumed_step is not None:
                self._wait(lambda step=resumed_step: max(self.commits, default=-1) > step, COMMIT_WAIT_S,
                           "a checkpoint newer than the last resume point")
            record = {"index": fault.index, "kind": fault.kind, "at_s": round(time.time() - began, 1)}
            if self.system == "ray-train" and fault.kind in RAY_TRAIN_SKIPS:
                record.update(skipped=RAY_TRAIN_SKIPS[fault.kind])
            elif fault.kind == "enospc" and self.disk is None:
                record.update(skipped=f"no small disk to fill: {self.disk_problem}")
            else:
                self._check_checkpoints(f"before fault {fault.index}")
                if self.interval_shown:  # what `checkpoint.interval` was when the fault came
                    record["interval_before"] = dict(self.interval_shown)
                record.update(getattr(self, f"_inject_{fault.kind}")(fault))
            previous_at = time.time() if "skipped" in record else record.pop("_injected_at")
            previous_resumed = record.pop("_resumed_at", None) or time.time()
            if "skipped" not in record:
                previous_resumed = self._settle(record, previous_resumed)
            resumed_step = record.get("resumed_from")
            self.records.append(record)
            print(f"[chaos] {self.name}: {json.dumps(record)}", flush=True)
        return self._finish(began)

    def _settle(self, record: dict, resumed_at: float) -> float:
        """After a fault the run may come back smaller (a preempted worker's slot, a node's return) and
        grow back through a planned resize: the next fault waits for 3 workers (at most 90 s more)."""
        if self.trail.world == 3:
            return resumed_at
        since, before = time.time(), self.trail.invocations()
        grown = self._wait(lambda: self.trail.world == 3 and self.trail.first_step_after(since, before, world=3),
                           90, "3 workers again")
        record["back_to_3_workers_s"] = round(grown[2] - resumed_at, 2) if grown else None
        return grown[2] if grown else time.time()

    def _finish(self, began: float) -> dict:
        self.trail.refresh()
        finish_at = self.trail.step + 20
        (self.trail.root / "finish").write_text(str(finish_at))
        final_path = self.trail.root / "final.json"
        for _ in range(3):  # a driver that died at the very end is run again, as during the soak
            self._wait(lambda: self.driver.poll() is not None, 600, "the end of the run", expect_exit=True)
            if final_path.exists() or self.driver.poll() is None:
                break
            self._driver_exited(expected=False)
        ended = time.time()
        self._check_checkpoints("at the end")
        import chaos_loop

        final = json.loads(final_path.read_text()) if final_path.exists() else None
        weights = None
        if final is not None:
            reference = chaos_loop.reference_weights(final["step"])
            difference = max(abs(a - b) for a, b in zip(final["weights"], reference))
            weights = {"step": final["step"], "max_abs_diff": difference, "equal": difference <= 1e-5}
        self.trail.refresh()
        outside = self.trail.summary()
        wall = ended - began
        if outside["median_step_s"]:
            outside["goodput"] = round(outside["final_step"] * outside["median_step_s"] / wall, 4)
            outside["redone_s"] = round(outside["steps_redone"] * outside["median_step_s"], 1)
        outside["wall_s"] = round(wall, 1)
        outside["kept_steps_per_s"] = round(outside["final_step"] / wall, 3)
        results = sorted(self.root.glob("result-*.json"), key=lambda p: int(p.stem.split("-")[1]))
        last = json.loads(results[-1].read_text()) if results else {}
        return {"system": self.system, "setting": self.setting, "name": self.name, "faults": self.records,
                "per_kind": _per_kind(self.records), "final_weights": weights, "outside": outside,
                "goodput": last.get("goodput"), "driver_launches": self.launch + 1,
                "failures_charged": sum(json.loads(p.read_text()).get("failures", 0) for p in results),
                "unexpected_driver_exits": self.unexpected_exits, "checkpoint_checks": self.checks,
                "committed_seen": len(self.commits), "lost_checkpoints": self.lost,
                "interval_at_end": self.interval_shown or None,
                "ended_with_final_step": bool(weights and weights["step"] == finish_at)}

    # ---- the driver -------------------------------------------------------------------------------
    def _spec(self) -> dict:
        save_every = None if self.setting == "auto" else int(self.setting)
        return {"system": self.system, "name": self.name, "storage": str(self.storage),
                "dir": str(self.trail.root), "save_every": save_every, "sleep": self.options.sleep_s,
                "interval": "auto" if self.setting == "auto" else None, "keep_last": KEEP_LAST,
                "hang_timeout_s": self.options.hang_timeout_s, "out": str(self.root)}

    def _start_driver(self) -> None:
        self.launch += 1
        spec = self.root / "spec.json"
        spec.write_text(json.dumps(self._spec()))
        env = dict(os.environ, RAY_ADDRESS=self.cluster.address, RAY_TRAIN_V2_ENABLED="1",
                   PYTHONPATH=os.pathsep.join([str(BENCH), str(REPO), os.environ.get("PYTHONPATH", "")]))
        log = open(self.root / f"driver-{self.launch}.log", "w")  # noqa: SIM115 - the child keeps it
        self.driver = subprocess.Popen(
            [python(), str(BENCH / "chaos.py"), "--driver", str(spec), "--launch", str(self.launch)],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=self.root)
        log.close()
        self.launch_times.append(time.time())

    def _driver_exited(self, expected: bool) -> None:
        """The driver is gone; unless that was the plan, say so and run the same command again."""
        if expected:
            return
        log = (self.root / f"driver-{self.launch}.log").read_text(errors="replace")
        self.unexpected_exits.append({"launch": self.launch, "rc": self.driver.returncode, "at": time.time(),
                                      "log_tail": log[-1500:]})
        print(f"[chaos] {self.name}: driver {self.launch} exited rc {self.driver.returncode}; rerunning", flush=True)
        self._start_driver()

    def _cli(self, *arguments: str) -> subprocess.CompletedProcess:
        """`rayzero <arguments> --storage ...` as a user types it (through the control plane)."""
        return subprocess.run([python(), "-m", "rayzero.cli", *arguments, "--storage", self.storage.as_uri()],
                              capture_output=True, text=True, timeout=600, check=False, cwd=REPO)

    # ---- watching -------------------------------------------------------------------------------
    def _wait(self, done, timeout_s: float, what: str, expect_exit: bool = False):
        """Poll until `done()` is truthy (returns it) or `timeout_s` passes (returns None); meanwhile read
        the trail, the run's status, and rerun a driver that exited unplanned."""
        deadline = time.time() + timeout_s
        while True:
            self.trail.refresh()
            self._poll_status()
            value = done()
            if value:
                return value
            if self.driver is not None and self.driver.poll() is not None and not expect_exit:
                self._driver_exited(expected=False)
            if time.time() > deadline:
                print(f"[chaos] {self.name}: timed out after {timeout_s:.0f}s waiting for {what}", flush=True)
                return None
            time.sleep(0.2)

    def _poll_status(self) -> None:
        """The checkpoints the controller reports committed, through the control plane (rayzero)."""
        if self.system != "rayzero" or time.time() < self._next_poll:
            return
        self._next_poll = time.time() + 0.5
        from rayzero.config.errors import RayZeroError
        from rayzero.control_api.client import connect

        try:
            if self._client is None:
                self._client = connect(self.name, storage=self.storage.as_uri(), timeout_s=2)
            status = self._client.status()
        except RayZeroError:
            if self._client is not None:
                self._client.close()
            self._client = None
            return
        for checkpoint in status.checkpoints:
            self.commits.setdefault(int(checkpoint.step), time.time())
        self.interval_shown = {key: value for key, value in status.extra.items() if key.startswith("checkpoint_interval")}

    # ---- no committed checkpoint lost ---------------------------------------------------------------
    def _check_checkpoints(self, when: str) -> None:
        """Every checkpoint a status listed as committed is loadable from the disks that exist until
        `keep_last` newer ones were committed (retention may remove it then)."""
        if self.system != "rayzero":
            return
        self.checks += 1
        for attempt in range(3):  # a commit meanwhile may make retention remove the oldest: look again
            committed = tag_dirs(self.node_local, self.name)
            kept = sorted(set(committed) | set(self.commits))[-KEEP_LAST:]
            problems = {step: unloadable_files(committed[step], self.node_local, self.name) if step in committed
                        else ["no node holds its manifest"] for step in kept if step in self.commits}
            problems = {step: files for step, files in problems.items() if files}
            if not problems:
                return
            time.sleep(1.0)
        self.lost.append({"when": when, "unloadable": {str(step): files for step, files in problems.items()}})


def _per_kind(records: list[dict]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for record in records:
        entry = out.setdefault(record["kind"], {"injected": 0, "survived": 0, "skipped": 0, "recovery_s": []})
        if "skipped" in record:
            entry["skipped"] += 1
            continue
        entry["injected"] += 1
        entry["survived"] += bool(record.get("survived"))
        if record.get("recovery_s") is not None:
            entry["recovery_s"].append(record["recovery_s"])
    return out
