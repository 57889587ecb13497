"""The chaos soak's regression test (issue 24 section 3): bench/chaos.py, rayzero only, for about a minute
and a half (alone on 2 cores) on its own local 3-node Ray cluster, six faults, one of each of the first
six kinds (a worker SIGKILLed, a worker SIGSTOPped, a node removed and returned, a worker SIGTERMed, the
checkpoint disk full for a while, the newest checkpoint's shard corrupted), and at the end the weights of
a fault-free single process and every committed checkpoint still loadable. Faults come close together
(gaps of 2-4 s, 2 s of training after each recovery, a 6 s hang timeout against the loop's ~0.06 s
steps): 93 s against 111 s with 5-9 s gaps, 5 s of settling and a 10 s hang timeout.

The harness runs as a subprocess (as a user types it), so its cluster and drivers are its own and end
with it. Only events and their order are asserted, never how long anything took: timings belong in
bench/results/chaos.json.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FIRST_SIX = ("kill", "hang", "node", "sigterm", "enospc", "corrupt")


def _can_mount_a_small_disk(tmp_path: Path) -> str:
    """'' when a loop-mounted ext4 image (the soak's checkpoint disk, which `enospc` fills) mounts here."""
    from bench.chaos_world import SmallDisk

    mounted = SmallDisk.mount(tmp_path / "probe", 8)
    if isinstance(mounted, str):
        return mounted
    mounted.unmount()
    return ""


def test_a_short_chaos_soak_survives_one_fault_of_each_of_the_first_six_kinds_and_loses_nothing(tmp_path):
    problem = _can_mount_a_small_disk(tmp_path)
    if problem:
        pytest.skip(f"the soak's `enospc` fault needs a small loop-mounted disk (root and mount(2)): {problem}")
    out = tmp_path / "chaos.json"
    try:
        done = subprocess.run(
            [sys.executable, str(REPO / "bench" / "chaos.py"), "--systems", "rayzero", "--seed", "0",
             "--minutes", "1", "--min-faults", "6", "--kinds", ",".join(FIRST_SIX), "--gap", "2:4", "--hold", "3:5",
             "--settle", "2", "--hang-timeout", "6",
             "--scratch", str(tmp_path), "--json", str(out)],
            cwd=REPO, capture_output=True, text=True, timeout=840, check=False)
    except subprocess.TimeoutExpired as expired:  # what the soak had said by then: where it stood
        said = [(part if isinstance(part, str) else part.decode(errors="replace")) if part else ""
                for part in (expired.stdout, expired.stderr)]
        pytest.fail(f"the soak did not end in {expired.timeout:.0f} s; its output so far:\n"
                    + said[0][-4000:] + "\n--- stderr ---\n" + said[1][-4000:])
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    run = json.loads(out.read_text())["rayzero"]
    faults = run["faults"]
    print("\n".join(json.dumps(fault) for fault in faults))

    # one of each of the six kinds first (the seeded order), none skipped, every one survived
    assert sorted(fault["kind"] for fault in faults[:6]) == sorted(FIRST_SIX)
    for fault in faults:
        assert "skipped" not in fault, fault
        assert fault["survived"], fault
    by_kind = {fault["kind"]: fault for fault in faults}
    # a new invocation of the loop resumed after every restarting fault, from a checkpoint
    for kind in ("kill", "hang", "node", "sigterm", "corrupt"):
        assert by_kind[kind]["recovery_s"] is not None and by_kind[kind]["resumed_from"] is not None, by_kind[kind]
    # the hung rank was ended by rayzero, not let go by the harness
    assert not by_kind["hang"].get("stopped_process_left_alive"), by_kind["hang"]
    # the node's return grew the run back to 3 workers
    assert by_kind["node"]["grew_back_s"] is not None, by_kind["node"]
    # the restart after the corruption loaded the damaged checkpoint itself, from its good copy
    assert by_kind["corrupt"]["corrupted_step"] is not None, by_kind["corrupt"]
    assert by_kind["corrupt"]["loaded_the_damaged_checkpoint_from_a_good_copy"], by_kind["corrupt"]
    # a full disk: training went on, nothing restarted, and a checkpoint committed once it was freed
    assert by_kind["enospc"]["steps_while_full"] > 0 and by_kind["enospc"]["restarts"] == 0, by_kind["enospc"]

    assert run["lost_checkpoints"] == [], run["lost_checkpoints"]
    assert run["checkpoint_checks"] >= len(faults) + 1 and run["committed_seen"] > 0
    assert run["unexpected_driver_exits"] == [], run["unexpected_driver_exits"]
    weights = run["final_weights"]
    assert weights is not None and run["ended_with_final_step"], weights
    assert weights["max_abs_diff"] <= 1e-5, weights
