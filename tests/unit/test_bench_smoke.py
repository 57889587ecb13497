"""bench/engine.py: the formulas behind its targets, and one tiny end-to-end run (< 30 s).

The benchmark's figures are ratios reported in JSON, never asserted here: these tests check that the
harness computes the paper's formulas right, turns rows into the issue's comparisons right, and
that a real invocation writes the documented JSON even when a system fails.
"""
from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]

from bench import report
from rayzero.config.run_settings import FailureConfig


def test_model_state_formula_follows_the_zero_paper_with_fp32_sizes() -> None:
    psi = 1000
    # stage 0 replicates everything: 4 (param) + 4 (grad) + 8 (Adam moments) bytes per parameter
    assert report.model_state_formula(0, psi, 4) == 16 * psi
    # stage 1 shards only the optimizer state
    assert report.model_state_formula(1, psi, 4) == 8 * psi + 8 * psi / 4
    # stage 2 shards gradients too
    assert report.model_state_formula(2, psi, 4) == 4 * psi + 12 * psi / 4
    # stage 3 shards everything; at one rank every stage holds the same 16 bytes per parameter
    assert report.model_state_formula(3, psi, 4) == 16 * psi / 4
    assert {report.model_state_formula(s, psi, 1) for s in range(4)} == {16 * psi}
    assert report.communication_ideal(2, psi) == 2 * psi
    assert report.communication_ideal(3, psi) == 3 * psi


def test_communication_uses_the_engines_paper_unit_total() -> None:
    stats = {"all_reduce": {"calls": 1, "elements": 10, "bytes": 40, "volume_elements": 20},
             "control": {"calls": 1, "elements": 1, "bytes": 4, "volume_elements": 2},
             "total": {"calls": 1, "elements": 10, "bytes": 40, "volume_elements": 20}}
    assert report.paper_elements(stats) == 20
    assert report.paper_elements({}) is None


def _row(system: str, seconds: float, **extra) -> dict:
    return {"system": system, "world_size": 2, "model": "mlp", "trainable_parameters": 100,
            "step_time_median_s": seconds, "step_time_min_s": seconds,
            "step_cpu_time_median_s": seconds, "losses": [1.0, 0.5], **extra}


def test_comparisons_compute_throughput_ratios_and_flag_failures() -> None:
    rows = report.annotate([
        _row("ddp", 0.10),
        _row("fsdp2", 0.20),
        _row("rayzero-stage0", 0.08, comm_stats={"total": {"volume_elements": 200}},
             model_state_bytes_per_rank=1600),
        _row("rayzero-stage3", 0.25, comm_stats={"total": {"volume_elements": 330}},
             model_state_bytes_per_rank=900, losses=[1.0, 0.6]),
        {"system": "deepspeed-stage0", "world_size": 2, "model": "mlp", "error": "boom"},
    ])
    found = {c["target"]: c for c in report.comparisons(rows)}
    vs_ddp = found["rayzero-stage0 throughput >= 1.00x ddp (mlp, world size 2)"]
    assert vs_ddp["value"] == pytest.approx(1.25) and vs_ddp["met"]
    vs_fsdp2 = found["rayzero-stage3 throughput >= 1.10x fsdp2 (mlp, world size 2)"]
    assert vs_fsdp2["value"] == pytest.approx(0.8) and not vs_fsdp2["met"]
    vs_deepspeed = found["rayzero-stage0 throughput >= 1.00x deepspeed-stage0 (mlp, world size 2)"]
    assert vs_deepspeed["value"] is None and not vs_deepspeed["met"]
    assert found["rayzero-stage0 (mlp, world size 2) comm elements = 1.00x ideal"]["met"]
    assert not found["rayzero-stage3 (mlp, world size 2) comm elements = 1.00x ideal"]["met"]  # 1.1x
    assert found["rayzero-stage0 (mlp, world size 2) model-state bytes <= 1.05x formula"]["met"]
    assert not found["rayzero-stage3 (mlp, world size 2) model-state bytes <= 1.05x formula"]["met"]  # 900/800
    assert not found["rayzero-stage3 loss trajectory matches ddp within 0.0001 (mlp)"]["met"]


@pytest.mark.timeout(90)
def test_a_real_invocation_writes_one_row_per_system_and_survives_failures(tmp_path: pathlib.Path) -> None:
    output = tmp_path / "engine.json"
    completed = subprocess.run(
        [sys.executable, str(REPOSITORY / "bench" / "engine.py"), "--quick", "--systems", "ddp,rayzero-stage0",
         "--models", "mlp", "--steps", "2", "--warmup", "1", "--memory-world-sizes", "2", "--json", str(output)],
        check=False, capture_output=True, text=True, timeout=85, cwd=REPOSITORY,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    document = json.loads(output.read_text())
    rows = {row["system"]: row for row in document["results"]}
    assert set(rows) == {"ddp", "rayzero-stage0"}
    ddp = rows["ddp"]
    assert "error" not in ddp, ddp.get("error")
    assert ddp["world_size"] == 2 and ddp["model"] == "mlp" and ddp["step_time_median_s"] > 0
    assert len(ddp["losses"]) == 3 and ddp["model_state_bytes_per_rank"] == 16 * ddp["trainable_parameters"]
    rayzero = rows["rayzero-stage0"]
    for key in ("comm_elements_per_step", "comm_elements_ideal", "model_state_bytes_per_rank",
                "model_state_bytes_formula"):
        assert key in rayzero
    # Either the engine ran and reported figures, or its failure is a row, not a crashed benchmark.
    assert ("error" in rayzero) or rayzero["comm_elements_ideal"] == 2 * rayzero["trainable_parameters"]
    assert any(c["target"].startswith("rayzero-stage0 throughput >= 1.00x ddp") for c in document["comparisons"])
    assert "ddp" in completed.stdout and "targets:" in completed.stdout


@pytest.mark.timeout(120)
def test_the_scale_bench_runs_the_real_controller_over_simulated_ranks_and_fits_exponents(tmp_path: pathlib.Path) -> None:
    from bench import scale_report

    assert scale_report.exponent([64, 256, 1024], [1.0, 4.0, 16.0]) == pytest.approx(1.0)
    assert scale_report.exponent([64, 256], [1.0, 16.0]) == pytest.approx(2.0)
    output = tmp_path / "scale.json"
    completed = subprocess.run(
        [sys.executable, str(REPOSITORY / "bench" / "scale.py"), "--quick", "--sizes", "8,16",
         "--sections", "checkpoint,logic,metrics", "--json", str(output)],
        check=False, capture_output=True, text=True, timeout=110, cwd=REPOSITORY,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    document = json.loads(output.read_text())
    assert [row["n"] for row in document["rows"]] == [8, 16]
    for row in document["rows"]:
        assert "error" not in row["logic"] and "error" not in row["checkpoint"], row
        # the default limit a user gets (FailureConfig.hang_timeout_s, 55 s), checked once a second
        assert row["logic"]["hang_detect_sim_s"] == FailureConfig().hang_timeout_s + 1.0 == 56.0
        assert row["checkpoint"]["manifest_bytes"] > 0 and row["metrics"]["part_rows"] == 5 * row["n"]
    assert "logic.heartbeat_round_cpu_s" in document["exponents"]
    assert any(target["target"].startswith("exponent of") for target in document["targets"])


def test_docs_scale_md_tables_are_the_ones_bench_results_give(tmp_path: pathlib.Path) -> None:
    from bench import scale_model

    doc = REPOSITORY / "docs" / "scale.md"
    assert scale_model.write_or_check(str(doc), check=True) == 0, "run: python bench/scale.py --doc docs/scale.md"
    stale = tmp_path / "scale.md"
    text = doc.read_text()
    start = text.index("<!-- scale:goodput -->")
    stale.write_text(text[:start] + text[start:].replace("%", "% ", 1))  # one figure edited by hand
    assert scale_model.write_or_check(str(stale), check=True) == 1
    assert scale_model.write_or_check(str(stale), check=False) == 0 and stale.read_text() == text


def test_the_gpu_bench_dry_run_on_cpu_compares_offload_with_deepspeeds_same_config(tmp_path: pathlib.Path) -> None:
    """bench/gpu.py's code path on the CPU (what bench/gpu_check.sh runs on a lent GPU): the offload
    section's variants, each against DeepSpeed on the same config, with DeepSpeed's losses as oracle."""
    output = tmp_path / "gpu.json"
    completed = subprocess.run(
        [sys.executable, str(REPOSITORY / "bench" / "gpu.py"), "--device", "cpu", "--quick", "--rounds", "1",
         "--sections", "offload", "--json", str(output)],
        check=False, capture_output=True, text=True, timeout=110, cwd=REPOSITORY,
    )
    assert completed.returncode == 0, completed.stderr[-2000:]
    document = json.loads(output.read_text())
    rows = {row["system"]: row for row in document["results"]}
    assert {"deepspeed-stage1-offload-cpu", "rayzero-stage3-offload-nvme"} <= set(rows)
    assert all(row.get("step_time_median_s") for row in rows.values()), [r.get("error") for r in rows.values()]
    pairs = {(p["rayzero"], p["reference"]): p for p in document["comparisons"]}
    for stage in (1, 2, 3):
        pair = pairs[(f"rayzero-stage{stage}-offload-cpu", f"deepspeed-stage{stage}-offload-cpu")]
        assert pair["loss_max_relative_gap"] < 1e-5 and pair["throughput_ratio"] > 0
    assert ("rayzero-stage2-offload-cpu", "rayzero-stage2-offload-cpu-after-backward") in pairs
    assert rows["rayzero-stage3-offload-nvme"]["offload_breakdown"]["nvme_write"] > 0
