"""Losing a node through `rayzero.fit`: node-local checkpoints only (no shared checkpoint path), 3 fake
nodes, one rank each. The node goes away with its disk; the run restarts with the 2 workers that now
fit, resumes from the survivors' copies and peer replicas, and ends with the weights of one process."""
from __future__ import annotations

import os
import shutil
import sys
import threading
import time
from pathlib import Path

import pytest

import rayzero

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
import elastic_loop  # noqa: E402 - the loop module next to this file


def test_node_loss_resumes_from_peer_replicas_with_fewer_workers(tmp_path, capsys):
    if ray.is_initialized():
        ray.shutdown()
    node_root = tmp_path / "node-local"
    os.environ["RAYZERO_NODE_LOCAL_DIR"] = str(node_root)  # inherited by the fake nodes' workers
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        nodes = [cluster.head_node] + [cluster.add_node(num_cpus=1) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, logging_level="WARNING")
        config = dict(elastic_loop.config(), checkpoint={"use_node_local_storage": True, "replicas": 1})
        box: dict = {}

        def run():
            try:
                box["result"] = rayzero.fit(
                    elastic_loop.train, config=config,
                    scaling=rayzero.ScalingConfig(num_workers=(2, 3), placement_strategy="SPREAD"),
                    run=rayzero.RunConfig(name="nodeloss", storage=(tmp_path / "runs").as_uri(), progress_interval_s=30),
                    failure=rayzero.FailureConfig(max_failures=1, backoff_s=0),
                    train_loop_config={"steps": 24, "sleep": 0.25, "save_every": 2})
            except BaseException as error:  # noqa: BLE001 - re-raised below
                box["error"] = error

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        lost = nodes[2]
        lost_dir = node_root / lost.node_id / "checkpoints" / "nodeloss"
        deadline = time.monotonic() + 120
        while not any((p / "manifest.json").exists() for p in lost_dir.glob("global_step*")):
            assert time.monotonic() < deadline and thread.is_alive(), box
            time.sleep(0.1)
        time.sleep(0.3)
        cluster.remove_node(lost)
        shutil.rmtree(node_root / lost.node_id)  # its disk is gone with it
        thread.join(240)
        assert "error" not in box, box.get("error")
        result = box["result"]
        history = [m for m in result.metrics_history if "step" in m]
        assert history[0]["world"] == 3 and history[-1]["world"] == 2 and result.failures == 1
        resumed = [m for m in history if m["attempt"] > 0]
        assert resumed[0]["started_at"] >= 2  # from a committed node-local checkpoint, not from scratch
        assert [m["step"] for m in resumed] == list(range(resumed[0]["started_at"] + 1, 25))
        loaded = [m for m in result.metrics_history if "loaded" in m][-1]
        assert loaded["loaded_step"] == resumed[0]["started_at"]
        assert loaded["loaded"] == pytest.approx(elastic_loop.reference_weights(loaded["loaded_step"]), abs=1e-5)
        final = [m for m in result.metrics_history if "final" in m][-1]
        assert final["final"] == pytest.approx(elastic_loop.reference_weights(24), abs=1e-5)
        assert not (tmp_path / "runs" / "nodeloss" / "checkpoints").exists() or not any(
            (tmp_path / "runs" / "nodeloss" / "checkpoints").glob("global_step*"))  # nothing on shared storage
    finally:
        os.environ.pop("RAYZERO_NODE_LOCAL_DIR", None)
        ray.shutdown()
        cluster.shutdown()
