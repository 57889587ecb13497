"""Killing the operator in the middle of a reconcile and starting it again leaves one RayJob per
attempt ([Note: one RayJob per attempt]): the crash seam exits the process right after a step."""
from __future__ import annotations

import pytest
from rayzero_operator.handlers import CRASH_EXIT_CODE
from testkit.k8s_support import example, wait_for

from rayzero.config.environment import OPERATOR_CRASH_AFTER


@pytest.mark.parametrize("step", ["ConfigMap", "RayJob", "status"])
def test_a_crash_mid_reconcile_then_a_restart_leaves_one_rayjob(cluster, operator_process, step):
    operator_process.kill()
    # Only this namespace: the crash must come from this job, not from another test's.
    operator_process.start(cluster.namespace, **{OPERATOR_CRASH_AFTER.name: step})
    cluster.create_job("crash", example("minimal"))
    assert operator_process.process.wait(timeout=30) == CRASH_EXIT_CODE
    before = len(cluster.ray_jobs("crash"))
    assert before == (0 if step == "ConfigMap" else 1)

    operator_process.start()
    wait_for(cluster.phase_is("crash", "Pending"), what="phase Pending after the restart")
    cluster.reconciled_again("crash")
    assert [job["metadata"]["name"] for job in cluster.ray_jobs("crash")] == ["crash-attempt-1"]
    created = [event for event in cluster.events("crash") if event.reason == "RayJobCreated"]
    assert len(created) <= 1  # at most once: a restarted operator never claims a second creation


def test_a_crash_while_starting_the_next_attempt_leaves_one_new_rayjob(cluster, operator_process):
    if not operator_process.running():
        operator_process.start()
    spec = example("minimal")
    spec["failurePolicy"] = {"maxRestarts": 2, "backoffSeconds": 0}
    cluster.create_job("again", spec)
    wait_for(lambda: cluster.ray_jobs("again"), what="attempt 1")
    wait_for(cluster.phase_is("again", "Pending"), what="phase Pending")
    operator_process.kill()

    operator_process.start(cluster.namespace, **{OPERATOR_CRASH_AFTER.name: "RayJob"})
    cluster.set_ray_job_status("again-attempt-1", jobDeploymentStatus="Failed", jobStatus="FAILED")
    assert operator_process.process.wait(timeout=30) == CRASH_EXIT_CODE
    assert len(cluster.ray_jobs("again")) == 2
    assert cluster.status("again")["attempt"] == 1  # the crash came before the status was written

    operator_process.start()
    status = wait_for(lambda: cluster.status("again").get("attempt") == 2 and cluster.status("again"),
                      what="status of attempt 2")
    assert status["restarts"] == 1
    cluster.reconciled_again("again")
    assert [job["metadata"]["name"] for job in cluster.ray_jobs("again")] == [
        "again-attempt-1", "again-attempt-2"]


def test_sigkill_during_a_burst_of_jobs_leaves_one_rayjob_each(cluster, operator_process):
    if not operator_process.running():
        operator_process.start()
    names = [f"burst-{index}" for index in range(6)]
    for name in names:
        cluster.create_job(name, example("minimal"))
    wait_for(lambda: any(cluster.ray_jobs(name) for name in names), what="the first RayJob")
    operator_process.kill()  # wherever it was: mid-create, mid-status, between the two
    operator_process.start()
    for name in names:
        wait_for(cluster.phase_is(name, "Pending"), what=f"{name} Pending")
    for name in names:
        cluster.reconciled_again(name)
        assert [job["metadata"]["name"] for job in cluster.ray_jobs(name)] == [f"{name}-attempt-1"]


def test_an_apiserver_restart_leaves_one_rayjob_and_the_operator_carries_on(cluster, envtest, operator):
    cluster.create_job("steady", example("minimal"))
    wait_for(cluster.phase_is("steady", "Pending"), what="phase Pending")
    envtest.restart_apiserver(down_seconds=2)
    # Watches reconnect and re-list everything: every job is seen again as if new.
    cluster.set_ray_job_status("steady-attempt-1", jobDeploymentStatus="Running", jobStatus="RUNNING")
    wait_for(cluster.phase_is("steady", "Running"), timeout=60, what="phase Running after the restart")
    cluster.reconciled_again("steady")
    assert [job["metadata"]["name"] for job in cluster.ray_jobs("steady")] == ["steady-attempt-1"]
    assert operator.running()
