"""The long tier: end-to-end scenarios that `make test` leaves out and `make test-long` runs.

[Note: the long tier]
`make test` must end within CI's limit (25 minutes for all of it on a 2-core machine, pytest about
15 of them) and pass on a fresh clone every time. With every test in it, it did neither: a fresh
clone's run here took 47 min of pytest (2026-11-29, three workers, 1,652 tests; the Ray tier's files
4,816 test-seconds, each test two to three times as long as alone). Most of that was OpenMP's
threads spinning on the loaded cores ([Note: one OpenMP thread per test process]); the rest is the
scenarios below: with both fixed a fresh clone's `make test` took 20.1 min, pytest 12.4 (1,588
passed), against 31.3 and 22.8 with the long tier alone. The scenarios below are each a whole run, often
with a node or a worker killed, and each exercises a capability another test in `make test` already
holds to the same oracle on a smaller path (named beside it). They run, in full, with `make
test-long` (or `make test-all` for both), before a change to the code they name lands; the soak
also runs as bench/chaos.py. A file or a test is listed by its node id prefix, with the test in
`make test` that covers its capability.
"""
from __future__ import annotations

LONG: dict[str, str] = {
    # Ray tier: whole runs with faults, restarts or nodes coming and going
    "tests/ray/test_chaos.py": "each of its six fault kinds has a test of its own: test_faults (kill, torn checkpoint), "
                               "test_first_hour (hang), test_node_loss (node), tests/dist/test_checkpoint_enospc_ranks (disk full)",
    "tests/ray/test_hf_trainer.py::test_a_planned_stop": "test_hf_trainer's offload run (the Trainer path), test_planned_stop's control target",
    "tests/ray/test_hf_trainer.py::test_a_worker_killed": "test_hf_trainer's offload run, test_faults' kill and resume",
    "tests/ray/test_path_new_user.py::test_the_hf_guide_auto_config_trains_consolidates_and_plots[3]": "its [2] case",
    "tests/ray/test_elastic_layouts.py": "test_elastic_grow (grow), test_node_loss (shrink), test_stage3_layouts (layout "
                                         "checkpoints across world sizes), test_multinode_emulated (the layout from Ray)",
    "tests/ray/test_goodput.py": "tests/unit/test_goodput_accounting (the accounting over recorded phases)",
    "tests/ray/test_hf_accelerate.py": "tests/dist/test_compile.py and test_compat_engine (Accelerate driving the engine)",
    "tests/ray/test_planned_stop.py::test_driver_sigterm": "test_planned_stop's control target (a planned stop and its rerun)",
    "tests/ray/test_lightning_fit.py": "test_lightning_run (a Lightning script resuming under rayzero run), test_lightning_strategy",
    "tests/ray/test_faults.py::test_a_hung_rank": "test_first_hour's stopped worker (the hang report), test_faults' kill",
    "tests/ray/test_faults.py::test_sigterm_to_a_worker": "test_node_loss (a planned regroup), tests/dist/test_preemption_words",
    "tests/ray/test_local_start.py": "none on a forced miss: the test heads of make test start through the same retry "
                                     "(testkit.local_ray), which a missed bound under load takes",
    "tests/ray/test_script_run.py::test_a_killed_worker": "test_lightning_run (a script resuming after a worker dies)",
    "tests/ray/test_first_hour.py::test_by_default": "test_fit's failure budget",
    "tests/ray/test_node_loss.py::test_a_planned_stop_of_a_node_local_run": "test_node_loss' peer replicas",
    "tests/ray/test_node_loss.py::test_a_drain_notice": "test_node_loss' peer replicas",
    "tests/ray/test_checkpoint_nodes.py": "test_node_loss' peer replicas",
    "tests/ray/test_path_shipping.py::test_the_issue_s_script_run_as_main_ships": "test_path_shipping's other cases",
    "tests/ray/test_path_shipping.py::test_a_module_level_torch_distributed_alias_ships": "test_path_shipping's other cases",
    "tests/ray/test_path_plot.py": "test_path_new_user's [2] case (it plots its run)",
    "tests/ray/test_path_cluster.py::test_a_stale_record": "test_path_cluster's other cases",
    "tests/ray/test_offload_examples.py::test_offload_example_trains_under_fit": "test_offload_examples' demo run, "
                                                                                "make docs-check (every example validates)",
    "tests/ray/test_stages.py::test_two_workers_report_a_falling_loss_at_every_stage": "tests/dist parity per stage, "
                                                                                       "test_stages' stage-3 resume",
    "tests/ray/test_control_e2e.py": "test_planned_stop's control target, test_control_fit, tests/k8s/test_control_real_run",
    "tests/ray/test_job_submit.py::test_ray_job_submit_runs_a_script_target": "test_job_submit's rayzero run, test_cli's file target",
    "tests/ray/test_elastic_grow.py": "test_planned_stop's control target (a resize to another world size), test_node_loss "
                                      "(a shrink), tests/unit/test_elastic_plan",
    "tests/ray/test_lightning_run.py": "tests/dist/test_lightning_strategy (RayZeroStrategy: a planned stop resumed by itself), "
                                       "test_script_run's as-main case (rayzero run of a script)",
    "tests/ray/test_path_shipping.py::test_torch_ops": "test_path_shipping's HF model case, test_fit (a loop shipped by value)",
    "tests/ray/test_path_cluster.py::test_re_run_steps": "the restarts of test_fit and test_faults, tests/unit/test_goodput_accounting",
    "tests/ray/test_script_run.py::test_fit_a_script_that_never_builds_an_engine": "test_script_run's as-main case",
    "tests/ray/test_elastic_stragglers.py": "tests/unit/test_controller_stragglers",
    "tests/ray/test_planned_stop.py::test_an_elasticity_block": "tests/unit/test_elastic_plan",
    "tests/ray/test_job_submit.py::test_ray_job_submit_reports_a_bad_config": "test_first_hour's CLI errors, tests/unit's config errors",
    # dist tier: measurements and long trainings
    "tests/dist/test_fidelity_memory.py": "bench/memory.py, tests/unit/test_estimate",
    "tests/dist/test_lightning_torchrun.py": "test_lightning_strategy (the same strategy on spawned ranks)",
    "tests/dist/test_compile.py::test_hf_trainer_accelerate_and_lightning_compile": "test_compile's one_rank engine case",
    "tests/dist/test_zero_init_torchrun.py": "test_zero_init_hf (zero.Init on spawned ranks)",
    "tests/dist/test_census_memory.py": "bench/memory.py (the same census, GPT-2), test_fidelity_memory",
    "tests/dist/test_engine_exit.py": "tests/dist/test_zero_init_torchrun (a torchrun script)",
    "tests/dist/test_zeropp_gpt.py": "test_stage3_layouts (every layout and its quantized collectives, step by step)",
    "tests/dist/test_compile.py::test_engine_compile_gives_eagers_losses_at_every_stage[two_ranks]": "its one_rank case",
    "tests/unit/test_bench_smoke.py::test_the_gpu_bench_dry_run": "bench/gpu_check.sh on a GPU",
}
