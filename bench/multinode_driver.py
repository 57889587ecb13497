"""The driver bench/multinode.py runs inside node 0's namespace ([Note: Ray on emulated nodes] in
bench/netcluster_ray.py): joins the emulated Ray cluster and runs one `rayzero.fit` per row.

`python -m bench.multinode_driver JOB.json` prints one JSON line: the job's rows, each with what its
rank 0 reported (bench/multinode_loop.py) or the error that ended it.
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any


def drive(job: dict[str, Any]) -> list[dict[str, Any]]:
    """Join the cluster at $RAY_ADDRESS, wait for its nodes, run the job's rows."""
    import ray

    from bench.netcluster_ray import wait_for_nodes

    started = time.monotonic()
    ray.init(address=os.environ["RAY_ADDRESS"], logging_level="WARNING")
    wait_for_nodes(job["nodes"])
    connect_s = time.monotonic() - started
    rows = run_rows(job)
    ray.shutdown()
    return [{**row, "connect_s": connect_s} for row in rows]


def run_rows(job: dict[str, Any]) -> list[dict[str, Any]]:
    """One `rayzero.fit` per row of `job` on the Ray this process is connected to."""
    import rayzero
    from bench.multinode_loop import train_loop
    from bench.netcluster_ray import WORKER_RESOURCES

    resources = dict(WORKER_RESOURCES) if job.get("cluster") else {"CPU": 1.0}  # no emulated nodes: plain CPUs
    storage = job.get("storage") or tempfile.mkdtemp(prefix="rz-multinode-runs-")
    out = []
    for index, row in enumerate(job["rows"]):
        started = time.monotonic()
        entry: dict[str, Any] = {"row": row["name"], "round": job.get("round", 0)}
        try:
            result = rayzero.fit(
                train_loop, config=row["config"],
                scaling=rayzero.ScalingConfig(num_workers=job["nodes"] * job["ranks_per_node"],
                                              resources_per_worker=resources),
                run=rayzero.RunConfig(name=f"{row['name'].replace('+', '-')}-r{job.get('round', 0)}-{index}",
                                      storage=f"file://{storage}", progress_interval_s=0),
                failure=rayzero.FailureConfig(max_failures=0, process_group_timeout_s=120),
                train_loop_config={**job["loop"], "cluster": job.get("cluster")},
            )
            entry.update((result.metrics or {}).get("bench") or {"error": "rank 0 reported nothing"})
            entry["fit_timings"] = dict(result.timings)
        except Exception as error:  # noqa: BLE001 - a row that fails is a row of the result
            entry["error"] = f"{type(error).__name__}: {error}"[:4000]
            entry["traceback"] = traceback.format_exc()[-4000:]
        entry["fit_wall_s"] = time.monotonic() - started
        out.append(entry)
    return out


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    print(json.dumps(drive(job)), flush=True)


if __name__ == "__main__":
    main()
