"""Losing a node through `rayzero.fit`: node-local checkpoints only (no shared checkpoint path), 3 fake
nodes, one rank each. The node goes away with its disk; the run restarts with the 2 workers that now
fit, resumes from the survivors' copies and peer replicas, and ends with the weights of one process."""
from __future__ import annotations

import os
import shutil
import threading
import time
from pathlib import Path

import pytest

import rayzero

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster
from testkit import elastic_loop
from testkit.actors import actors_made
from testkit.local_ray import add_node, controller_at_step, own_ports


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """3 fake nodes of 1 CPU; each node's workers see their own node-local directory."""
    if ray.is_initialized():
        ray.shutdown()
    node_root = tmp_path_factory.mktemp("node-local")
    os.environ["RAYZERO_NODE_LOCAL_DIR"] = str(node_root)  # inherited by the fake nodes' workers
    made = Cluster()
    try:
        nodes = [add_node(made, num_cpus=1, include_dashboard=False, **own_ports())]
        nodes += [add_node(made, num_cpus=1) for _ in range(2)]
        made.wait_for_nodes()
        ray.init(address=made.address, logging_level="WARNING")
        yield made, nodes, node_root
    finally:
        os.environ.pop("RAYZERO_NODE_LOCAL_DIR", None)
        ray.shutdown()
        made.shutdown()


def _fit_in_thread(tmp_path, name: str, workers, steps: int, save_every: int | None, max_failures: int = 0):
    config = dict(elastic_loop.config(), checkpoint={"use_node_local_storage": True, "replicas": 1})
    box: dict = {}

    def run():
        try:
            box["result"] = rayzero.fit(
                elastic_loop.train, config=config,
                scaling=rayzero.ScalingConfig(num_workers=workers, placement_strategy="SPREAD"),
                run=rayzero.RunConfig(name=name, storage=(tmp_path / "runs").as_uri(), progress_interval_s=30),
                failure=rayzero.FailureConfig(max_failures=max_failures, backoff_s=0),
                train_loop_config={"steps": steps, "sleep": 0.25, "save_every": save_every})
        except BaseException as error:  # noqa: BLE001 - re-raised by the test
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _check(result, steps: int, worlds: tuple[int, int], failures: int):
    history = [m for m in result.metrics_history if "step" in m]
    assert (history[0]["world"], history[-1]["world"]) == worlds and result.failures == failures
    resumed = [m for m in history if m["attempt"] > 0]
    assert resumed[0]["started_at"] >= 2  # from a committed node-local checkpoint, not from scratch
    assert [m["step"] for m in resumed] == list(range(resumed[0]["started_at"] + 1, steps + 1))
    loaded = [m for m in result.metrics_history if "loaded" in m][-1]
    assert loaded["loaded_step"] == resumed[0]["started_at"]
    assert loaded["loaded"] == pytest.approx(elastic_loop.reference_weights(loaded["loaded_step"]), abs=1e-5)
    final = [m for m in result.metrics_history if "final" in m][-1]
    assert final["final"] == pytest.approx(elastic_loop.reference_weights(steps), abs=1e-5)


def _newest_on_the_nodes(node_root: Path, name: str) -> int | None:
    steps = [int(p.parent.name.removeprefix("global_step"))
             for p in node_root.glob(f"*/checkpoints/{name}/global_step*/manifest.json")]
    return max(steps, default=None)


def test_a_planned_stop_of_a_node_local_run_knows_its_boundary_checkpoint(cluster, tmp_path):
    """The stop's checkpoint is written on the nodes' disks after the last heartbeat that could have
    seen it (found by bench/chaos.py: `rayzero stop` named an older checkpoint, or none): the reply,
    `Result.checkpoint_step` and goodput (nothing redone) must know it all the same."""
    _, _, node_root = cluster
    thread, box = _fit_in_thread(tmp_path, "nodestop", 2, 10_000, save_every=None)  # never saves itself
    controller = controller_at_step("nodestop", 3, thread, box, 120)[0]
    record = ray.get(controller.stop.remote(120.0))
    thread.join(240)
    assert "error" not in box, box.get("error")
    result = box["result"]
    boundary = _newest_on_the_nodes(node_root, "nodestop")
    final = [m for m in result.metrics_history if "final" in m][-1]
    assert boundary is not None and final["final_step"] == boundary  # the one checkpoint: the stop's
    assert record is not None and record.step == boundary, record
    assert result.stopped and result.checkpoint_step == boundary
    assert result.goodput["badput_s"]["redone steps"] == 0, result.goodput


def _every_cpu_is_free(count: int) -> None:
    """The previous test's fit returned once Ray showed its workers' CPUs free again ([Note: resources
    back]): an elastic run sizes itself to what is free (before, it once started at 2 of (2, 3)
    workers here, the previous test's CPUs not yet back)."""
    assert ray.available_resources().get("CPU", 0) == count, ray.available_resources()


def test_node_loss_resumes_from_peer_replicas_with_fewer_workers(cluster, tmp_path):
    made, nodes, node_root = cluster
    _every_cpu_is_free(3)
    relays = actors_made("NodeRelay")
    thread, box = _fit_in_thread(tmp_path, "nodeloss", (2, 3), 24, save_every=2, max_failures=1)
    lost = nodes[2]
    lost_dir = node_root / lost.node_id / "checkpoints" / "nodeloss"
    # rank 0 may be on the node to be lost: its reports must have reached the controller first, or the
    # history starts at the restart (reports not yet collected from a node die with it; seen once)
    controller_at_step("nodeloss", 3, thread, box, 120)
    deadline = time.monotonic() + 120
    while not any((p / "manifest.json").exists() for p in lost_dir.glob("global_step*")):
        assert time.monotonic() < deadline and thread.is_alive(), box
        time.sleep(0.1)
    time.sleep(0.3)
    made.remove_node(lost)
    shutil.rmtree(node_root / lost.node_id)  # its disk is gone with it
    thread.join(240)
    assert "error" not in box, box.get("error")
    _check(box["result"], 24, (3, 2), failures=1)
    # one rank per node, 3 then 2 ranks in all: too few for a relay actor; the controller gathers them
    # itself ([Note: relays for small nodes]; it was a relay actor per node: 3, then 2)
    assert actors_made("NodeRelay") == relays
    shared = tmp_path / "runs" / "nodeloss" / "checkpoints"
    assert not any(shared.glob("global_step*"))  # nothing went through shared storage


def test_a_drain_notice_checkpoints_and_regroups_without_the_node(cluster, tmp_path):
    made, nodes, node_root = cluster
    from ray._raylet import GcsClient
    from ray.core.generated import autoscaler_pb2

    # Nodes 0 and 1 are left: test_node_loss... removes node 2, but `make test-long` runs this test
    # without it (the long tier), and with 3 nodes the run's 2 ranks could land on node 2
    # (2026-11-29: test-long failed so). Removed here when still there.
    alive = {node["NodeID"] for node in ray.nodes() if node["Alive"]}
    for extra in nodes[2:]:
        if extra.node_id in alive:
            made.remove_node(extra)
            deadline = time.monotonic() + 60
            while any(node["Alive"] for node in ray.nodes() if node["NodeID"] == extra.node_id):
                assert time.monotonic() < deadline, "the extra node did not leave"
                time.sleep(0.2)
    _every_cpu_is_free(2)
    thread, box = _fit_in_thread(tmp_path, "drain", (1, 2), 16, save_every=None)  # never saves itself
    draining = nodes[1]
    run_dir = node_root / draining.node_id / "checkpoints" / "drain"
    controller = controller_at_step("drain", 3, thread, box, 120)[0]
    assert {r.node_id for r in ray.get(controller.status.remote()).ranks} == {nodes[0].node_id, draining.node_id}
    accepted, why = GcsClient(address=made.address).drain_node(
        draining.node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"),
        "spot reclaim (test)", int((time.time() + 60) * 1000))
    assert accepted, why
    thread.join(240)
    assert "error" not in box, box.get("error")
    _check(box["result"], 16, (2, 1), failures=0)  # planned: no budget used, nothing lost
    assert any((p / "manifest.json").exists() for p in run_dir.glob("global_step*"))  # the boundary save
