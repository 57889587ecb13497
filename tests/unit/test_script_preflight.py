"""A script target's pre-flight: what `rayzero run SCRIPT.py` refuses before anything starts, and how
the config a script's own arguments name is checked ([Note: script config flags])."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from rayzero.config.errors import ConfigError, RayZeroValueError
from rayzero.driver.scripts import prepare_script
from rayzero.integrations.script_args import Script, check_config_flags, config_flags, trainer_facts

BAD_KEYS = {"train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 2, "overlap_com": True}}
# the HF guide's ZeRO-2 shape: every trainer value "auto", a scheduler only the Trainer can size
GUIDE = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
         "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
         "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                           "warmup_num_steps": "auto", "total_num_steps": "auto"}},
         "zero_optimization": {"stage": 2}}


def _write(path: Path, content: dict) -> Path:
    path.write_text(json.dumps(content))
    return path


def test_the_config_flags_a_script_can_carry(tmp_path):
    found = [(f.flag, f.value, f.trainer) for f in config_flags(
        ["--deepspeed", "a.json", "--deepspeed=b.json", "--deepspeed", "--deepspeed_config", "c.json",
         "--deepscale_config=d.json", "--output_dir", "out", "--deepspeed", '{"train_batch_size": 4}'])]
    assert found == [("--deepspeed", "a.json", True), ("--deepspeed", "b.json", True),
                     ("--deepspeed_config", "c.json", False), ("--deepscale_config", "d.json", False),
                     ("--deepspeed", {"train_batch_size": 4}, True)]
    assert list(config_flags(["--deepspeed", "--lr", "3"])) == []  # DeepSpeed's switch, no config named
    arguments = _write(tmp_path / "args.json", {"output_dir": "out", "deepspeed": "ds.json"})
    assert [(f.value, f.trainer) for f in config_flags([str(arguments)])] == [("ds.json", True)]  # HF's JSON form


def test_trainer_values_come_from_hf_s_own_parser_without_checking_the_driver_s_hardware():
    # --bf16 on this CPU-only machine: TrainingArguments(...) itself would refuse it ("Your setup doesn't support
    # bf16/gpu"); the workers may well have GPUs.
    facts = trainer_facts(["--output_dir", "out", "--per_device_train_batch_size", "4", "--bf16",
                           "--warmup_steps", "0.1", "--model_name_or_path", "gpt2", "--learning_rate", "3e-5"])
    assert facts["per_device_train_batch_size"] == 4 and facts["bf16"] is True and facts["learning_rate"] == 3e-5
    assert facts["warmup_ratio"] == 0.1 and "warmup_steps" not in facts  # transformers 5: below 1 is a ratio
    assert facts["gradient_accumulation_steps"] == 1 and facts["adam_beta2"] == 0.999  # HF's defaults
    assert "max_steps" not in facts  # -1: from the dataset, known only in the Trainer


def test_a_deepspeed_file_is_checked_with_the_trainer_s_values(tmp_path):
    guide = _write(tmp_path / "guide.json", GUIDE)
    check_config_flags(["--deepspeed", str(guide), "--output_dir", "out"], 2)  # every "auto" the Trainer fills
    with pytest.raises(ConfigError) as bad:
        check_config_flags(["--output_dir", "out", f"--deepspeed={_write(tmp_path / 'bad.json', BAD_KEYS)}"], 2)
    text = str(bad.value)
    assert "--deepspeed" in text and "zero_optimization.overlap_com = true" in text
    assert "did you mean `zero_optimization.overlap_comm`" in text
    pinned = _write(tmp_path / "pinned.json", {"train_micro_batch_size_per_gpu": 4})
    check_config_flags(["--deepspeed", str(pinned), "--per_device_train_batch_size", "4"], 2)
    with pytest.raises(ConfigError) as disagrees:
        check_config_flags(["--deepspeed", str(pinned), "--per_device_train_batch_size", "8"], 2)
    assert "train_micro_batch_size_per_gpu = 4: disagrees with trainer per_device_train_batch_size = 8" in str(
        disagrees.value)


def test_deepspeed_s_own_flag_is_checked_with_deepspeed_s_semantics(tmp_path):
    # No trainer fills "auto" behind --deepspeed_config: DeepSpeed itself would refuse it.
    with pytest.raises(ConfigError) as refused:
        check_config_flags(["--deepspeed", "--deepspeed_config", str(_write(tmp_path / "g.json", GUIDE))], 2)
    assert "--deepspeed_config" in str(refused.value) and "optimizer.params.lr" in str(refused.value)


def test_a_missing_file_and_a_value_the_trainer_would_refuse_are_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RayZeroValueError, match=r"--deepspeed nope.json: no such file .*nope.json"):
        check_config_flags(["--deepspeed", "nope.json"], 2)
    _write(tmp_path / "ds.json", {"train_micro_batch_size_per_gpu": 2})
    with pytest.raises(RayZeroValueError, match="--learning_rate.*invalid float value: 'abc'"):
        check_config_flags(["--deepspeed", "ds.json", "--learning_rate", "abc"], 2)


def test_prepare_script_refuses_what_cannot_run_naming_file_and_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RayZeroValueError, match="script 'missing.py': no such file"):
        prepare_script(Script("missing.py"), 2)
    (tmp_path / "broken.py").write_text("import os\n\ndef main(:\n    pass\n")
    with pytest.raises(RayZeroValueError, match=r"broken.py:3: .*does not compile"):
        prepare_script(Script("broken.py"), 2)
    with pytest.raises(RayZeroValueError, match="-m no_such_module_here: no module named"):
        prepare_script(Script("no_such_module_here", module=True), 2)
    (tmp_path / "train.py").write_text("print('never run on the driver')\n")
    launch = prepare_script(Script("train.py", args=["--x", "1"]), 2)
    assert (launch.target, launch.args, launch.path, launch.cwd) == ("train.py", ("--x", "1"),
                                                                    str(tmp_path / "train.py"), str(tmp_path))
    with pytest.raises(RayZeroValueError, match="give a list of strings"):
        Script("train.py", args="--x 1")


def _rayzero_run(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    # A dead RAY_ADDRESS: a check made after connecting would fail on it instead ("no Ray cluster answers").
    env = dict(os.environ, RAY_ADDRESS="127.0.0.1:1")
    return subprocess.run([sys.executable, "-m", "rayzero.cli", "run", *args], cwd=cwd, env=env, text=True,
                          capture_output=True, timeout=300, check=False)


def test_rayzero_run_refuses_before_anything_starts(tmp_path):
    (tmp_path / "broken.py").write_text("x = (\n")
    (tmp_path / "train.py").write_text("print('hello')\n")
    _write(tmp_path / "bad.json", BAD_KEYS)
    cases = {
        ("missing.py", "--workers", "2"): "script 'missing.py': no such file",
        ("broken.py", "--workers", "2"): "broken.py:1: '(' was never closed (the script does not compile",
        ("train.py", "--workers", "2", "--", "--output_dir", "out", "--deepspeed", "bad.json"):
            "zero_optimization.overlap_com = true: unknown key",
    }
    for args, message in cases.items():
        done = _rayzero_run(tmp_path, *args)
        assert done.returncode == 2, (args, done.stdout, done.stderr)
        assert message in done.stderr, (args, done.stderr)
        assert "no Ray cluster answers" not in done.stderr and "[rayzero] run" not in done.stdout
    assert not (tmp_path / "runs").exists()  # no run directory either
