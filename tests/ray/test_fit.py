"""rayzero.fit on a real local Ray: reports, context, errors, resources, config, datasets, retries."""
from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from testkit.actors import actors_made

import rayzero
from rayzero.config import ConfigError
from rayzero.driver.metrics_store import read_metrics

CONFIG = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1}


def _run(tmp_path, **overrides):
    return rayzero.RunConfig(storage=tmp_path.as_uri(), progress_interval_s=0, **overrides)


def _two():
    return rayzero.ScalingConfig(num_workers=2)


def reporting_loop(config):
    import torch
    import torch.distributed as dist

    context = rayzero.get_context()
    total = torch.tensor([float(context.rank + 1)])
    dist.all_reduce(total)  # proves the process group spans both workers
    for step in range(config["steps"]):
        rayzero.report({"step": step, "rank": context.rank, "sum_of_ranks": total.item()})
    shard = rayzero.get_dataset_shard("train")
    ids = [int(value) for batch in shard.iter_batches(batch_size=8) for value in batch["id"]]
    env = {key: os.environ.get(key) for key in (
        "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "RAYZERO_CONFIG", "RAYZERO_CHECKPOINT_DIR", "RAYZERO_NODE_ID", "RAYZERO_NODE_LOCAL_DIR")}
    rayzero.report({"env": env, "node_local_exists": os.path.isdir(env["RAYZERO_NODE_LOCAL_DIR"]),
                    "run_name": context.run_name, "storage": context.storage,
                    "config_micro_batch": context.config["train_micro_batch_size_per_gpu"],
                    "count": len(ids), "total": sum(ids)})


def test_reports_in_order_with_the_worker_environment_a_split_dataset_and_the_wall_clock_phases(
        local_ray, tmp_path, capsys):
    """One run proves: every report of rank 0 reaches the driver in order and every rank's lands in the
    Parquet log; the workers see the run's environment and config; a dataset is split equally across
    the workers; `wall_clock_breakdown` prints the driver's phase timings."""
    import ray.data

    config = dict(CONFIG, wall_clock_breakdown=True)
    relays = actors_made("NodeRelay")
    result = rayzero.fit(reporting_loop, config=config, scaling=_two(), run=_run(tmp_path, name="order"),
                         train_loop_config={"steps": 40}, datasets={"train": ray.data.range(64)})
    # both ranks on one node: the controller gathered them itself ([Note: one node, no relay actor])
    assert actors_made("NodeRelay") == relays
    steps = [m["step"] for m in result.metrics_history if "step" in m]
    assert steps == list(range(40))  # rank 0's reports, every one, in order
    assert all(m["rank"] == 0 and m["sum_of_ranks"] == 3.0 for m in result.metrics_history if "step" in m)
    last = result.metrics
    env = last["env"]
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2" and env["LOCAL_WORLD_SIZE"] == "2"
    # below the kernel's ephemeral range, where no outgoing connection takes it before rank 0 binds it
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert 20000 <= int(env["MASTER_PORT"]) < low or low <= 20001, (env["MASTER_PORT"], low)  # else: no room
    assert last["run_name"] == "order" and last["storage"] == f"{tmp_path.as_uri()}/order"  # from $RAYZERO_RUN
    assert env["RAYZERO_CHECKPOINT_DIR"] == f"{tmp_path}/order/checkpoints"
    assert env["RAYZERO_NODE_LOCAL_DIR"].endswith(env["RAYZERO_NODE_ID"]) and last["node_local_exists"]
    assert last["config_micro_batch"] == 4
    assert result.path == f"{tmp_path.as_uri()}/order"
    # every rank's reports land in the Parquet log
    table = read_metrics(str(tmp_path / "order")).to_pydict()
    for rank in (0, 1):
        seqs = [s for r, s in zip(table["rank"], table["seq"]) if r == rank]
        assert seqs == list(range(41))
    assert result.timings["fit_to_first_report_s"] > 0
    # the dataset: equal shares (no rank waits on another at the end), every row once
    counts = [count for count in table["count"] if count is not None]
    assert counts == [32, 32]
    assert sum(total for total in table["total"] if total is not None) == sum(range(64))
    assert last["count"] == 32
    out = capsys.readouterr().out
    assert "wall clock breakdown" in out
    for phase in ("placement_group_s", "worker_start_s", "process_group_s", "fit_to_first_report_s"):
        assert phase in out


def test_a_group_s_shutdown_returns_once_ray_shows_its_cpus_free(local_ray):
    """[Note: resources back]: what comes right after a group's shutdown (a preemption's regroup, a
    resize, a script's next fit) sizes itself to the free slots. Before, the slots read right after
    it were still taken (0 of 2 here, back ~50 ms later on an idle machine, longer under load)."""
    from rayzero.config.run_settings import ScalingConfig
    from rayzero.controller.worker_group import RayWorkerGroup, free_worker_slots

    before = free_worker_slots({"CPU": 1.0})
    group = RayWorkerGroup(ScalingConfig(num_workers=2), 2, {}, 60.0)
    group.start()
    assert free_worker_slots({"CPU": 1.0}) == before - 2
    group.shutdown(until_free=True)  # as after a run's end, a preemption or a resize
    assert free_worker_slots({"CPU": 1.0}) == before


def failing_loop(config):
    """Rank 1 fails in every attempt, each time another way: 0, before rank 0 has reported; 1, after
    rank 0's report; 2, deep inside its own code."""
    import torch.distributed as dist

    context = rayzero.get_context()
    if context.attempt == 0 and context.rank == 1:
        raise RuntimeError("simulated crash before rank 0 has reported")
    if context.attempt == 0:
        time.sleep(0.5)  # rank 0 reports after rank 1 has already failed
    rayzero.report({"attempt": context.attempt, "resume_from": context.resume_from})
    if context.attempt == 0:
        return
    dist.barrier()  # a step ends in a collective: rank 1 fails after rank 0 reported, never before it
    if context.rank == 1 and context.attempt == 1:
        raise RuntimeError("simulated crash after rank 0 has reported")
    if context.rank == 1:
        raise_deep_inside(3)


def raise_deep_inside(step):
    raise ValueError(f"boom at step {step}")


def test_failures_within_the_budget_restart_the_group_and_the_one_past_it_names_its_rank_and_traceback(
        local_ray, tmp_path):
    """max_failures=2, three failures of rank 1: attempt 0's comes before rank 0 reports (rank 0's report,
    made while the failure is handled, still reaches the driver); attempt 1's after rank 0's report;
    each restart resumes from the given checkpoint (nothing newer was committed). Attempt 2's, past the
    budget, fails the run with an error that names rank 1 and carries its traceback."""
    given = tmp_path / "given-checkpoints"
    given.mkdir()
    (given / "latest").write_text("global_step3")
    with pytest.raises(rayzero.TrainingFailedError) as raised:
        rayzero.fit(failing_loop, config=CONFIG, scaling=_two(),
                    run=_run(tmp_path, name="failing", resume_from=given.as_uri()),
                    failure=rayzero.FailureConfig(max_failures=2, backoff_s=0))
    error = raised.value
    assert error.rank == 1
    assert "rank 1" in str(error) and "ValueError: boom at step 3" in str(error)
    assert "raise_deep_inside" in error.traceback_text and "raise_deep_inside" in str(error)
    # rank 0's reports as `Result.metrics_history` holds them (the same log); attempt 2's report may
    # or may not have been collected before its failure ended the run
    table = read_metrics(str(tmp_path / "failing")).to_pydict()
    rows = [(attempt, resume_from) for rank, attempt, resume_from
            in zip(table["rank"], table["attempt"], table["resume_from"]) if rank == 0]
    assert [attempt for attempt, _ in rows] in ([0, 1], [0, 1, 2]), rows
    assert {resume_from for _, resume_from in rows} == {str(given)}


def test_an_impossible_resource_request_fails_within_the_bounded_wait(local_ray, tmp_path):
    scaling = rayzero.ScalingConfig(num_workers=2, resources_per_worker={"CPU": 64}, placement_timeout_s=3)
    started = time.monotonic()
    with pytest.raises(rayzero.TrainingFailedError) as raised:
        rayzero.fit(failing_loop, config=CONFIG, scaling=scaling, run=_run(tmp_path),
                    failure=rayzero.FailureConfig(max_failures=0))
    elapsed = time.monotonic() - started
    assert elapsed >= 3  # it waited out the placement timeout (then failed, naming it)
    message = str(raised.value)
    assert "could not place 2 worker(s)" in message and "'CPU': 64" in message
    assert "placement_timeout_s=3" in message and "Fix:" in message


def marker_loop(config):
    open(config["marker"], "w").close()


def test_a_bad_config_is_rejected_before_any_worker_starts(local_ray, tmp_path):
    marker = tmp_path / "worker-ran"
    bad = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 7, "overlap_com": True}}
    with pytest.raises(ConfigError) as raised:
        rayzero.fit(marker_loop, config=bad, scaling=_two(), run=_run(tmp_path),
                    train_loop_config={"marker": str(marker)})
    text = str(raised.value)
    assert "zero_optimization.stage" in text and "overlap_com" in text  # every problem, at once
    assert not marker.exists()


def test_an_auto_only_trainer_arguments_resolve_is_rejected_before_any_worker_starts(local_ray, tmp_path):
    # the workers resolve "auto" from the model and world size only; an "auto" learning rate would
    # otherwise start every worker and fail in each
    marker = tmp_path / "worker-ran"
    config = {**CONFIG, "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto"}}
    with pytest.raises(ConfigError) as raised:
        rayzero.fit(marker_loop, config=config, scaling=_two(), run=_run(tmp_path),
                    train_loop_config={"marker": str(marker)})
    # not stage3_prefetch_bucket_size: the engine resolves that one from the model
    assert [problem.path for problem in raised.value.problems] == ["optimizer.params.lr"]
    assert "trainer={...}" in str(raised.value)  # says how to give the trainer argument to fit
    assert not marker.exists()


def test_nvme_offload_without_a_path_is_rejected_before_any_worker_starts(local_ray, tmp_path):
    marker = tmp_path / "worker-ran"
    config = {**CONFIG, "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                              "offload_param": {"device": "nvme"}}}
    with pytest.raises(ConfigError) as raised:
        rayzero.fit(marker_loop, config=config, scaling=_two(), run=_run(tmp_path),
                    train_loop_config={"marker": str(marker)})
    assert [problem.path for problem in raised.value.problems] == ["zero_optimization.offload_param.nvme_path"]
    assert not marker.exists()
