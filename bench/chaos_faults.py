"""The faults of the chaos soak (the list in bench/chaos.py's module docstring), each injected into
the running soak and judged: `Faults` is the half of `chaos_soak.Soak` that injects; the soak supplies
the cluster, the trail, the driver and `_wait`.
"""
from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

from chaos_world import _alive, add_worker_node, flip_bytes, tag_dirs


def _signal(pid: int, which: int) -> bool:
    try:
        os.kill(pid, which)
        return True
    except ProcessLookupError:
        return False


class Faults:
    """Injection and judgement of each fault kind (mixed into `chaos_soak.Soak`)."""

    def _resumed(self, injected_at: float, old: set[str], world: int | None = None):
        """Wait for the first step of a new invocation after the fault."""
        return self._wait(lambda: self.trail.first_step_after(injected_at, old, world),
                          self.options.recovery_timeout_s, "training to resume")

    def _outcome(self, injected_at: float, old: set[str], resumed, **extra) -> dict:
        out = {"_injected_at": injected_at, "survived": resumed is not None, **extra}
        if resumed is None:
            return out
        invocation, _, when, world = resumed
        # the step the run had reached when it went down: the newest old invocation's last step (not the
        # largest step any old invocation reached: one from before an earlier loss was redone already)
        reached = next((s for i, s, t, _ in reversed(self.trail.steps) if i in old and t <= when), 0)
        loaded = self.trail.loads.get(invocation)
        out.update(_resumed_at=when, recovery_s=round(when - injected_at, 2), world_after=world,
                   resumed_from=loaded, steps_lost=(reached - loaded) if loaded is not None else reached)
        return out

    def _victim(self, fault) -> tuple[int, int, str]:
        ranks = self._wait(self.trail.ranks, 60, "the ranks' pids") or {}
        rank = sorted(ranks)[int(fault.pick * len(ranks))]
        return rank, *ranks[rank]

    # ---- the faults ([the module docstring of bench/chaos.py]) -----------------------------------
    def _inject_kill(self, fault) -> dict:
        return self._signal_a_rank(fault, signal.SIGKILL)

    def _inject_sigterm(self, fault) -> dict:
        return self._signal_a_rank(fault, signal.SIGTERM)

    def _signal_a_rank(self, fault, which: int) -> dict:
        rank, pid, _ = self._victim(fault)
        old, injected_at = self.trail.invocations(), time.time()
        _signal(pid, which)
        return self._outcome(injected_at, old, self._resumed(injected_at, old), victim=f"rank {rank}")

    def _inject_hang(self, fault) -> dict:
        rank, pid, _ = self._victim(fault)
        old, injected_at = self.trail.invocations(), time.time()
        _signal(pid, signal.SIGSTOP)
        out = self._outcome(injected_at, old, self._resumed(injected_at, old), victim=f"rank {rank}",
                            hang_timeout_s=self.options.hang_timeout_s)
        if _alive(pid):  # nobody ended the stopped process: let it go on (and fail) rather than leak it
            out["stopped_process_left_alive"] = True
            _signal(pid, signal.SIGCONT)
        return out

    def _inject_node(self, fault) -> dict:
        rank, _, node_id = self._victim(fault)
        node = next((n for n in self.cluster.worker_nodes if n.node_id == node_id), None)
        if node is None:
            return {"_injected_at": time.time(), "survived": False, "detail": f"rank {rank}'s node {node_id} unknown"}
        old, injected_at = self.trail.invocations(), time.time()
        self.cluster.remove_node(node)
        shutil.rmtree(self.node_local / node_id, ignore_errors=True)  # its disk went with it
        out = self._outcome(injected_at, old, self._resumed(injected_at, old), victim=f"rank {rank}'s node",
                            node_away_s=fault.hold_s)
        self._wait(lambda: time.time() >= injected_at + fault.hold_s, fault.hold_s + 60, "the node's return")
        returned_at, before = time.time(), self.trail.invocations()
        add_worker_node(self.cluster)
        self._back_to_three(out, "grew_back_s", returned_at, before)
        return out

    def _inject_enospc(self, fault) -> dict:
        old, injected_at = self.trail.invocations(), time.time()
        step_before = self.trail.step
        while time.time() < injected_at + fault.hold_s:
            self.disk.fill()  # again and again: retention frees what it deletes
            self._wait(lambda: True, 0, "")
            time.sleep(0.5)
        steps_while_full = self.trail.step - step_before
        self.disk.release()
        released_at = time.time()
        newest = max(self.commits, default=-1)
        committed = self._wait(lambda: max(self.commits, default=-1) > newest, 120, "a commit after the full disk")
        restarted = self.trail.invocations() - old
        return {"_injected_at": injected_at, "_resumed_at": time.time(), "disk_full_s": round(released_at - injected_at, 1),
                "steps_while_full": steps_while_full, "restarts": len(restarted),
                "survived": bool(committed) and steps_while_full > 0 and not restarted,
                "recovery_s": round(time.time() - released_at, 2) if committed else None,
                "detail": "recovery_s: from freeing the disk to the next committed checkpoint"}

    def _inject_corrupt(self, fault) -> dict:
        ranks = self._wait(self.trail.ranks, 60, "the ranks' pids") or {}
        for pid, _ in ranks.values():  # nothing commits while the newest checkpoint is picked and damaged
            _signal(pid, signal.SIGSTOP)
        try:
            rank, target = self._corruption_target(ranks, fault)
            corrupted = _step_of(target)
            if target is not None:
                flip_bytes(target)
            old, injected_at = self.trail.invocations(), time.time()
            _signal(ranks[rank][0], signal.SIGKILL)  # the restart must load what was damaged
        finally:
            for pid, _ in ranks.values():
                _signal(pid, signal.SIGCONT)
        out = self._outcome(injected_at, old, self._resumed(injected_at, old), victim=f"rank {rank}",
                            corrupted=str(target.relative_to(self.root)) if target else None, corrupted_step=corrupted)
        if self.system == "rayzero" and out.get("resumed_from") is not None and corrupted is not None:
            still = corrupted in tag_dirs(self.node_local, self.name)
            out["loaded_the_damaged_checkpoint_from_a_good_copy"] = out["resumed_from"] == corrupted
            out["survived"] = out["survived"] and (out["resumed_from"] == corrupted or not still)
        elif out.get("resumed_from") is not None and corrupted is not None:  # Ray Train: one copy, no checksum
            out["loaded_the_damaged_checkpoint_unnoticed"] = out["resumed_from"] == corrupted
            out["survived"] = out["survived"] and out["resumed_from"] != corrupted
        return out

    def _corruption_target(self, ranks: dict[int, tuple[int, str]], fault) -> tuple[int, Path | None]:
        """(the rank to kill, the file to damage): rank r's own shard of the newest checkpoint on
        r's node (rayzero), or the newest checkpoint's state file (Ray Train)."""
        order = sorted(ranks)
        start = int(fault.pick * len(order))
        if self.system != "rayzero":
            newest = max((self.storage / self.name).glob("checkpoint_*/state.pt"), key=os.path.getmtime, default=None)
            return order[start], newest
        committed = tag_dirs(self.node_local, self.name)
        if not committed:
            return order[start], None
        step = max(committed)
        for rank in order[start:] + order[:start]:
            directory = self.node_local / ranks[rank][1] / "checkpoints" / self.name / f"global_step{step}"
            own = directory / f"rank{rank:05d}.safetensors"
            if (directory / "manifest.json").exists() and own.exists():
                return rank, own
        return order[start], None

    def _inject_driver(self, fault) -> dict:
        old, injected_at = self.trail.invocations(), time.time()
        self.driver.kill()
        self.driver.wait()
        self._start_driver()
        return self._outcome(injected_at, old, self._resumed(injected_at, old), victim="the driver (SIGKILL), rerun")

    def _inject_stop(self, fault) -> dict:
        old, injected_at = self.trail.invocations(), time.time()
        if self.system == "rayzero":
            done = self._cli("stop", self.name)
            how = f"`rayzero stop` rc {done.returncode}: {(done.stdout + done.stderr).strip()[-300:]}"
        else:  # Ray Train has no planned stop: the operator interrupts the driver (Ctrl-C)
            self.driver.send_signal(signal.SIGINT)
            how = "SIGINT to the driver (Ray Train has no planned stop)"
        exited = self._wait(lambda: self.driver.poll() is not None, 300, "the driver to stop", expect_exit=True)
        rc = self.driver.returncode
        if not exited:
            self.driver.kill()
            self.driver.wait()
        self._start_driver()
        return self._outcome(injected_at, old, self._resumed(injected_at, old), victim=how, driver_rc=rc)

    def _inject_scale(self, fault) -> dict:
        old, injected_at = self.trail.invocations(), time.time()
        target = 2 if self.trail.world == 3 else 3
        done = self._cli("scale", self.name, str(target))
        out = self._outcome(injected_at, old, self._resumed(injected_at, old, world=target),
                            victim=f"`rayzero scale {target}` rc {done.returncode}")
        if target != 3:  # back to the whole range, so growing back is not capped at 2 for the rest
            back_at, before = time.time(), self.trail.invocations()
            self._cli("scale", self.name, "3")
            self._back_to_three(out, "scaled_back_s", back_at, before)
        return out

    def _back_to_three(self, out: dict, key: str, since: float, before: set[str]) -> None:
        """Survived only if a new invocation with 3 workers steps after `since` (within 180 s)."""
        grown = self._wait(lambda: self.trail.first_step_after(since, before, world=3), 180, "3 workers again")
        out[key] = round(grown[2] - since, 2) if grown else None
        out["survived"] = out["survived"] and grown is not None
        if grown:
            out["_resumed_at"] = grown[2]


def _step_of(path: Path | None) -> int | None:
    """The step of the checkpoint `path` belongs to: its rayzero tag directory, or the `step` in a Ray
    Train checkpoint's state file (read before it is damaged)."""
    if path is None:
        return None
    if path.name == "state.pt":
        import torch

        return int(torch.load(path, weights_only=True)["step"])
    for part in reversed(path.parts):
        if part.startswith("global_step"):
            return int(part.removeprefix("global_step"))
    return None
