"""`rayzero run` and `rayzero demo` in-process on the shared local Ray (the job-submit test runs them
as a Ray job)."""
from __future__ import annotations

import json
import textwrap

from rayzero.driver import cli, demo
from rayzero.driver.metrics_store import read_metrics

LOOP = textwrap.dedent(
    """
    import rayzero
    from helper_module import scale


    def loop(config):
        steps = int(config["argv"][config["argv"].index("--steps") + 1])
        for step in range(steps):
            rayzero.report({"step": step, "value": scale(step)})
    """
)


FILE_TARGET = textwrap.dedent(
    """
    import os
    import threading

    import torch

    import rayzero
    from helper_module import scale
    from rayzero.engine.config_resolution import resolve_config

    LOCK = threading.Lock()  # cannot be pickled: rayzero.fit(loop) would refuse it by name
    IMPORTED_IN = os.getpid()


    def loop(config):
        steps = int(config["argv"][config["argv"].index("--steps") + 1])
        resolved = resolve_config(None, 2, torch.nn.Linear(4, 4))  # the run's config, its "auto"s filled
        for step in range(steps):
            with LOCK:
                rayzero.report({"step": step, "value": scale(step), "imported_here": IMPORTED_IN == os.getpid(),
                                "micro": resolved.train_micro_batch_size_per_gpu,
                                "batch": resolved.train_batch_size, "lr": resolved.optimizer.params["lr"]})
    """
)


def _project(tmp_path):
    (tmp_path / "helper_module.py").write_text("def scale(x):\n    return 10 * x\n")
    (tmp_path / "train.py").write_text(LOOP)
    (tmp_path / "ds.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2}))
    return tmp_path


def test_run_a_file_target_imports_it_on_each_worker_with_its_args_and_the_trainer_s_facts(
        local_ray, tmp_path, capsys):
    """One `rayzero run file.py:loop --trainer ... -- --steps 4` on two workers proves:
    - without `--trainer`, every unresolved HF "auto" is named in one round (exit 2);
    - the loop's arguments after `--` reach it and a module next to the file imports there (rank 0
      reports scale(step) for 4 steps); the run's last line counts the reports;
    - the file is imported on each worker, not pickled: its module-level lock could not be pickled,
      and its module level ran in the worker's own process on both ranks;
    - `--trainer` arguments fill the HF autos (micro batch, global batch, learning rate)."""
    project = _project(tmp_path)
    (project / "target.py").write_text(FILE_TARGET)
    (project / "auto.json").write_text(json.dumps({
        "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "train_batch_size": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    argv = [f"{project}/target.py:loop", "--config", str(project / "auto.json"), "--workers", "2",
            "--storage", (tmp_path / "runs").as_uri(), "--name", "cli"]
    assert cli.main(argv + ["--", "--steps", "4"]) == 2  # without the trainer arguments: every unresolved auto
    err = capsys.readouterr().err
    assert "train_micro_batch_size_per_gpu" in err and "optimizer.params.lr" in err and "--trainer" in err

    code = cli.main(argv + ["--trainer", "per_device_train_batch_size=3", "--trainer", "learning_rate=0.01",
                            "--trainer", "gradient_accumulation_steps=2", "--", "--steps", "4"])
    assert code == 0, capsys.readouterr().err
    assert "[rayzero] finished: 4 report(s)" in capsys.readouterr().out
    table = read_metrics(str(tmp_path / "runs" / "cli")).to_pydict()
    rank0 = [v for r, v in zip(table["rank"], table["value"]) if r == 0]
    assert rank0 == [0, 10, 20, 30]
    assert sorted(table["rank"]) == [0] * 4 + [1] * 4 and all(table["imported_here"]), table
    assert set(zip(table["micro"], table["batch"], table["lr"])) == {(3, 12, 0.01)}


def test_run_a_module_target_from_the_working_directory(local_ray, tmp_path, monkeypatch, capsys):
    project = _project(tmp_path)
    monkeypatch.chdir(project)
    code = cli.main(["train:loop", "--config", "ds.json", "--workers", "1", "--", "--steps", "2"])
    assert code == 0, capsys.readouterr().err
    assert list((project / "runs").glob("rayzero-*/metrics.parquet"))  # default storage: ./runs


def test_run_rejects_a_bad_target_and_a_bad_config_without_starting_workers(local_ray, tmp_path, capsys):
    project = _project(tmp_path)
    assert cli.main([f"{project}/train.py:nope", "--config", str(project / "ds.json")]) == 2
    assert "has no function 'nope'" in capsys.readouterr().err
    (project / "bad.json").write_text(json.dumps({"train_micro_batch_size_per_gpu": 2, "zero_optimisation": {}}))
    assert cli.main([f"{project}/train.py:loop", "--config", str(project / "bad.json")]) == 2
    err = capsys.readouterr().err
    assert "no worker was started" in err and "zero_optimization" in err  # names the nearest valid key


def test_demo_writes_its_summary_as_json(local_ray, tmp_path, capsys):
    summary_path = tmp_path / "summary.json"
    code = demo.main(["--steps", "12", "--workers", "2", "--json", str(summary_path),
                      "--storage", (tmp_path / "runs").as_uri()])
    assert code == 0, capsys.readouterr().err
    summary = json.loads(summary_path.read_text())
    assert summary["steps"] == 12 and summary["workers"] == 2
    assert summary["final_loss"] < summary["initial_loss"] - 0.5
    assert summary["checkpoint"] and summary["tokens_per_s"] > 0
    out = capsys.readouterr().out
    assert "loss 4." in out and "metrics:" in out
    progress = [line for line in out.splitlines() if line.startswith("[rayzero] step 12 |")]
    assert progress and "samples/s" in progress[-1] and "tokens/s" in progress[-1]
    assert " r0 " in progress[-1] and " r1 " in progress[-1]  # memory of every rank


def test_input_errors_are_one_line_naming_the_flag_or_file_and_line(tmp_path, capsys):
    project = _project(tmp_path)
    config = str(project / "ds.json")
    assert cli.main([f"{project}/train.py:loop", "--config", config, "--workers", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rayzero run: --workers 0: give a count >= 1") and "\n" not in err.strip()
    (project / "broken.py").write_text("import rayzero\n\n\ndef loop(config:\n    pass\n")
    assert cli.main([f"{project}/broken.py:loop", "--config", config]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rayzero run: {project}/broken.py:4: ") and "does not compile" in err
    assert "\n" not in err and "Traceback" not in err
    (project / "raising.py").write_text("import os\n\nimport no_such_module_here\n")
    assert cli.main([f"{project}/raising.py:loop", "--config", config]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"rayzero run: {project}/raising.py:3: importing it raised ModuleNotFoundError: "
                   "No module named 'no_such_module_here'")
