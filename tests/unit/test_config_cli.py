"""`rayzero config validate|schema|docs` and the config package's import weight."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rayzero.config import cli
from rayzero.config.docs import main as docs_main
from rayzero.config.docs import render

ROOT = Path(__file__).resolve().parents[2]


def test_validate_reports_top_level_and_nested_typos_with_suggestions(tmp_path, capsys):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"gradient_clipp1ng": 1.0, "train_micro_batch_size_per_gpu": 2,
                                "zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memroy": True}}}))
    from rayzero.cli import main as rayzero_main  # the `rayzero` console script

    assert rayzero_main(["config", "validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert "gradient_clipp1ng" in err and "did you mean `gradient_clipping`" in err
    assert "zero_optimization.offload_param.pin_memroy" in err
    assert "did you mean `zero_optimization.offload_param.pin_memory`" in err


def test_validate_prints_normalised_config_and_every_note(capsys):
    code = cli.main(["validate", str(ROOT / "examples" / "ds_zero3_auto.json"), "--world-size", "4",
                     "--hidden-size", "512", "--trainer", "per_device_train_batch_size=2",
                     "--trainer", "gradient_accumulation_steps=1", "--trainer", "max_grad_norm=1.0",
                     "--trainer", "learning_rate=3e-5", "--trainer", "adam_beta1=0.9", "--trainer", "adam_beta2=0.999",
                     "--trainer", "adam_epsilon=1e-8", "--trainer", "weight_decay=0", "--trainer", "warmup_steps=10",
                     "--trainer", "fp16=true"])
    out, err = capsys.readouterr()
    assert code == 0, err
    printed = json.loads(out)
    assert printed["zero_optimization"]["reduce_bucket_size"] == 512 * 512
    assert printed["train_batch_size"] == 8
    assert "auto: zero_optimization.stage3_param_persistence_threshold = 5120 from hidden_size=512 (10·h)" in err


def test_validate_without_facts_fails_naming_the_flags_unless_allowed(capsys):
    example = str(ROOT / "examples" / "hf_zero3.json")
    assert cli.main(["validate", example]) == 2
    assert "--hidden-size" in capsys.readouterr().err
    assert cli.main(["validate", example, "--allow-auto"]) == 0
    assert "still \"auto\"" in capsys.readouterr().err


def test_schema_and_docs(tmp_path, capsys):
    assert cli.main(["schema"]) == 0
    assert "stage3_prefetch_bucket_size" in json.loads(capsys.readouterr().out)["$defs"]["ZeroConfig"]["properties"]
    doc = tmp_path / "config.md"
    assert docs_main(["--check", str(doc)]) == 1  # missing = stale
    assert cli.main(["docs", "--write", str(doc)]) == 0
    assert docs_main(["--check", str(doc)]) == 0
    doc.write_text(doc.read_text().replace("Samples per rank", "Samples per GPU"))
    assert docs_main(["--check", str(doc)]) == 1


def test_committed_docs_are_current_and_cover_every_field():
    text = render()
    assert (ROOT / "docs" / "config.md").read_text() == text, "run: python -m rayzero.config.docs --write docs/config.md"
    for key in ("`stage3_prefetch_bucket_size` (attribute `prefetch_bucket_size`)", "`offload_param`",
                "`use_node_local_storage`", "`per_device_train_batch_size`", "`offload_params_device`"):
        assert key in text
    for line in text.splitlines():  # the flags column may be empty; the description may not
        if line.startswith("| `") and not line.startswith("| `" + "from_lightning"):
            assert not line.rstrip().endswith("|  |"), f"field without a docstring: {line}"


def test_rayzero_cli_dispatches_and_config_stays_light():
    # `rayzero config ...` must never import torch or ray (the operator and CI validate with it)
    code = ("import sys, rayzero.cli as c; rc = c.main(['config', 'schema']);"
            "assert rc == 0; import rayzero.config.lightning, rayzero.config.docs;"
            "bad = [m for m in ('torch', 'ray') if m in sys.modules]; assert not bad, bad")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_validate_prints_each_note_once(tmp_path):
    # a warning note (stage-3-only key below stage 3) and an information note (a rounded size); run
    # as a user runs it, in a fresh process (pytest's log capture would hide the logger's copy)
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2, "reduce_bucket_size": 943718.4,
                                                      "offload_param": {"device": "cpu"}}}))
    run = subprocess.run([sys.executable, "-c", "import sys; from rayzero.cli import main; sys.exit(main(sys.argv[1:]))",
                          "config", "validate", str(path)], capture_output=True, text=True, timeout=60,
                         check=False, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert run.returncode == 0, run.stderr
    assert run.stderr.count("only applies to ZeRO stage 3") == 1, run.stderr
    assert run.stderr.count("rounded: zero_optimization.reduce_bucket_size") == 1, run.stderr


def test_validate_with_trainer_values_agrees_with_what_run_accepts(capsys):
    """Issue 21 item 3: the same `--trainer` values `rayzero run` takes validate, HF's defaults filling
    every TrainingArguments value not given (warm-up included), the world size taken as given."""
    arguments = ["config", "validate", str(ROOT / "examples" / "ds_zero3_auto.json"), "--world-size", "2",
                 "--hidden-size", "64", "--trainer", "per_device_train_batch_size=4", "--trainer", "learning_rate=3e-3"]
    assert cli.main(arguments[1:]) == 0, capsys.readouterr().err
    config = json.loads(capsys.readouterr().out)
    assert config["train_batch_size"] == 8 and config["optimizer"]["params"]["betas"] == [0.9, 0.999]
    assert config["scheduler"]["params"]["warmup_num_steps"] == 1 and config["fp16"]["enabled"] is False
    from rayzero.driver.config_check import validated_config

    _, validated, _ = validated_config(str(ROOT / "examples" / "ds_zero3_auto.json"), 2,
                                       {"per_device_train_batch_size": 4, "learning_rate": 3e-3})
    assert {key: validated[key] for key in ("train_batch_size", "optimizer", "scheduler", "fp16")} == {
        key: config[key] for key in ("train_batch_size", "optimizer", "scheduler", "fp16")}
