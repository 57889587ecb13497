"""An elastic run with hpZ across nodes: 2 nodes x 2 workers -> a node is lost -> 1 node x 2 -> a node
joins -> 2 x 2 again. The hpZ groups (zero_hpz_partition_size 2: the ranks of a node) are rebuilt at
every attempt ([Note: stage-3 layouts]); the run resumes from its checkpoints at each world size and
ends with the weights of one process running plain SGD over the same global batches."""
from __future__ import annotations

import threading
import time

import pytest

import rayzero
from rayzero.driver.fit import controller_actor_name

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster
from testkit import elastic_loop
from testkit.local_ray import add_node, own_ports

STEPS, BATCH = 40, 16


@pytest.fixture
def two_nodes():
    if ray.is_initialized():
        ray.shutdown()
    made = Cluster()
    try:
        nodes = [add_node(made, num_cpus=2, include_dashboard=False, **own_ports()), add_node(made, num_cpus=2)]
        made.wait_for_nodes()
        ray.init(address=made.address, logging_level="WARNING")
        yield made, nodes
    finally:
        ray.shutdown()
        made.shutdown()


def _config() -> dict:
    config = elastic_loop.config(batch=BATCH)
    config["zero_optimization"] = {"stage": 3, "zero_hpz_partition_size": 2, "stage3_param_persistence_threshold": 0,
                                   "stage3_max_reuse_distance": 0}
    return config


def _world(controller) -> int:
    return ray.get(controller.status.remote()).world_size


def test_hpz_run_shrinks_to_one_node_and_grows_back_to_two(two_nodes, tmp_path, capsys):
    made, nodes = two_nodes
    box: dict = {}

    def run():
        try:
            box["result"] = rayzero.fit(
                elastic_loop.train, config=_config(), scaling=rayzero.ScalingConfig(num_workers=(2, 4)),
                run=rayzero.RunConfig(name="hpz", storage=tmp_path.as_uri(), progress_interval_s=30),
                failure=rayzero.FailureConfig(max_failures=1, backoff_s=0),
                train_loop_config={"steps": STEPS, "sleep": 0.25, "save_every": 2})
        except BaseException as error:  # noqa: BLE001 - re-raised by the test
            box["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 180
    controller = None
    while controller is None or ray.get(controller.status.remote()).step < 4:
        assert time.monotonic() < deadline and thread.is_alive(), box
        try:
            controller = controller or ray.get_actor(controller_actor_name("hpz"))
        except ValueError:
            pass
        time.sleep(0.2)
    assert _world(controller) == 4
    made.remove_node(nodes[1])
    while _world(controller) != 2 or ray.get(controller.status.remote()).step < 12:
        assert time.monotonic() - deadline < 600 and thread.is_alive(), box  # a guard, not a timing
        time.sleep(0.5)
    add_node(made, num_cpus=2)
    while thread.is_alive() and _world(controller) != 4:
        assert time.monotonic() - deadline < 900, box
        time.sleep(0.5)
    thread.join(300)
    assert "error" not in box, box.get("error")
    result = box["result"]
    worlds = [m["world"] for m in result.metrics_history if "step" in m]
    assert [w for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]] == [4, 2, 4], worlds
    assert result.failures == 1
    final = [m for m in result.metrics_history if "final" in m][-1]
    assert final["final_step"] == STEPS
    assert final["final"] == pytest.approx(elastic_loop.reference_weights(STEPS, batch=BATCH), abs=1e-5)
