"""Lightning on rayzero's engine (issue 20 item 5) in a real 2-rank gloo group that the Trainer forms
itself, as under torchrun: Lightning's demo BoringModel and Transformer trained with
`RayZeroStrategy` end with the weights `strategy="ddp"` gives (compared after `rayzero checkpoint
consolidate` of what `trainer.save_checkpoint` wrote), resume from those checkpoints, stop at a
planned step boundary and resume by themselves on a restart. One spawn runs every case."""
from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("lightning")
from lightning_workers import BATCHES, DATA_SEED, no_group, run_cases, write_text
from random_streams import moved_streams
from testkit.harness import spawn

STAGE3_OFFLOAD = {"stage": 3, "offload_optimizer": True}


def _cases(directory: str) -> list[tuple[str, str, dict]]:
    def save(name: str) -> str:
        return os.path.join(directory, f"{name}.ckpt")

    accumulate = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.01, "limit_train_batches": 2 * BATCHES}
    text_dir = os.path.join(directory, "text")
    write_text(os.path.join(text_dir, "wikitext-2.txt"))
    return [
        ("ddp1", "boring", {"kind": "ddp", "save": save("ddp1")}),
        ("ddp2", "boring", {"kind": "ddp", "epochs": 2, "save": save("ddp2")}),
        ("z3", "boring", {"keywords": STAGE3_OFFLOAD, "save": save("z3"), "predict": save("z3")}),
        ("z3_resumed", "boring", {"keywords": STAGE3_OFFLOAD, "epochs": 2, "ckpt_path": save("z3"),
                                  "model_seed": 123, "save": save("z3_resumed")}),
        ("z3_full", "boring", {"keywords": STAGE3_OFFLOAD, "epochs": 2, "save": save("z3_full")}),
        *[(f"z{stage}", "boring", {"keywords": {"stage": stage}, "save": save(f"z{stage}")}) for stage in (0, 1, 2)],
        ("ddp_accumulate", "boring", {"kind": "ddp", "trainer": accumulate, "save": save("ddp_accumulate")}),
        ("z2_accumulate", "boring", {"keywords": {"stage": 2}, "trainer": accumulate, "save": save("z2_accumulate")}),
        ("full_weights", "boring", {"keywords": {"stage": 3, "load_full_weights": True}, "epochs": 2,
                                    "ckpt_path": save("ddp1"), "model_seed": 123, "save": save("full_weights")}),
        ("bf16", "boring", {"keywords": {"stage": 2}, "epochs": 3, "model": "constant_rate",
                            "trainer": {"precision": "bf16-mixed"}}),
        ("fp16", "boring", {"keywords": {"stage": 1}, "epochs": 3, "model": "constant_rate", "plugin": "16-mixed"}),
        ("ddp_configure", "boring", {"kind": "ddp", "model": "configure_model", "save": save("ddp_configure")}),
        ("z3_configure", "boring", {"keywords": STAGE3_OFFLOAD, "model": "configure_model", "save": save("z3_configure")}),
        ("ddp_manual", "boring", {"kind": "ddp", "model": "manual", "save": save("ddp_manual")}),
        ("z2_manual", "boring", {"keywords": {"stage": 2}, "model": "manual", "save": save("z2_manual")}),
        ("clip_by_value", "boring", {"refused": True, "trainer": {"gradient_clip_val": 0.5,
                                                                  "gradient_clip_algorithm": "value"}}),
        ("two_optimizers", "boring", {"refused": True, "model": "two_optimizers"}),
        ("tf_ddp", "transformer", {"kind": "ddp", "data_dir": text_dir, "save": save("tf_ddp")}),
        ("tf_z3", "transformer", {"keywords": STAGE3_OFFLOAD, "data_dir": text_dir, "save": save("tf_z3")}),
        ("streams_ddp", "streams", {"kind": "ddp", "save": save("streams_ddp")}),
        *[(f"streams_z{stage}", "streams", {"keywords": {"stage": stage}, "save": save(f"streams_z{stage}")})
          for stage in (0, 1, 2)],
        ("streams_z3", "streams", {"keywords": STAGE3_OFFLOAD, "save": save("streams_z3")}),
        *[(f"{name}_resumed", "streams", {**spec, "max_steps": 20, "ckpt_path": save(name), "save": save(f"{name}_resumed")})
          for name, spec in (("streams_ddp", {"kind": "ddp"}), ("streams_z3", {"keywords": STAGE3_OFFLOAD}))],
        ("stop", "planned_stop", {"keywords": STAGE3_OFFLOAD, "ask_at": BATCHES - 1,
                                  "dirpath": os.path.join(directory, "stop_ckpts"),
                                  "run_dir": os.path.join(directory, "run"), "save": save("stop_{attempt}")}),
    ]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[list[dict], str]:
    """Every case, run once on both ranks: (results by rank, the directory holding the checkpoints)."""
    directory = str(tmp_path_factory.mktemp("lightning"))
    return spawn(2, run_cases, _cases(directory), init=no_group), directory


def _expected_predictions(weights: dict[str, torch.Tensor]) -> torch.Tensor:
    import lightning.pytorch as pl
    from lightning.pytorch.demos.boring_classes import BoringDataModule, BoringModel

    pl.seed_everything(DATA_SEED, verbose=False)
    BoringModel()  # draws its initial weights first, as in the ranks
    data = BoringDataModule()
    data.setup("predict")
    inputs = torch.stack([data.random_predict[i] for i in range(len(data.random_predict))])
    return inputs @ weights["layer.weight"].T + weights["layer.bias"]


def _weights(directory: str, name: str) -> dict[str, torch.Tensor]:
    """A DDP checkpoint's state_dict, or `rayzero checkpoint consolidate` of a RayZeroStrategy one."""
    path = os.path.join(directory, f"{name}.ckpt")
    if os.path.isfile(path):
        return torch.load(path, weights_only=False)["state_dict"]
    from safetensors.torch import load_file

    from rayzero.checkpoint.cli import main as checkpoint_cli

    out = os.path.join(directory, f"{name}.safetensors")
    assert checkpoint_cli(["consolidate", path, out]) == 0
    return load_file(out)


def _assert_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(actual) == sorted(expected)
    for key, value in expected.items():
        assert actual[key].dtype == torch.float32
        difference = (actual[key] - value).abs().max() / value.abs().max()
        assert difference <= 1e-5, (key, float(difference))


def test_boring_model_at_stage_3_with_offload_ends_with_ddps_weights(trained):
    _, directory = trained
    _assert_close(_weights(directory, "z3"), _weights(directory, "ddp1"))
    assert os.path.isfile(os.path.join(directory, "z3.ckpt", "checkpoint", "manifest.json"))  # DeepSpeed's layout


def test_stages_0_1_2_end_with_ddps_weights(trained):
    _, directory = trained
    for stage in (0, 1, 2):
        _assert_close(_weights(directory, f"z{stage}"), _weights(directory, "ddp1"))


def test_a_model_built_in_configure_model_is_partitioned_as_it_is_built(trained):
    ranks, directory = trained
    assert all(result["z3_configure"]["partitioned_at_build"] for result in ranks)  # rayzero.zero.Init
    assert not any(result["ddp_configure"]["partitioned_at_build"] for result in ranks)
    _assert_close(_weights(directory, "z3_configure"), _weights(directory, "ddp_configure"))  # same initial values


def test_manual_optimization_runs_backward_and_the_step_in_the_engine(trained):
    _, directory = trained
    _assert_close(_weights(directory, "z2_manual"), _weights(directory, "ddp_manual"))


def test_what_deepspeedstrategy_refuses_is_refused_with_the_reason(trained):
    for result in trained[0]:
        assert "LightningSetupError" in result["clip_by_value"]["refused"]
        assert "global norm only" in result["clip_by_value"]["refused"]
        assert "one optimizer" in result["two_optimizers"]["refused"]


def test_small_transformer_at_stage_3_with_offload_ends_with_ddps_weights(trained):
    _, directory = trained
    expected = _weights(directory, "tf_ddp")
    assert len(expected) > 20  # embedding, encoder/decoder layers, attention projections, decoder head
    _assert_close(_weights(directory, "tf_z3"), expected)


def test_fit_from_a_checkpoint_continues_at_its_step_and_equals_an_uninterrupted_run(trained):
    ranks, directory = trained
    for result in ranks:
        assert result["z3"]["global_step"] == BATCHES
        assert result["z3_resumed"]["start_step"] == BATCHES  # continued, nothing trained twice
        assert result["z3_resumed"]["global_step"] == 2 * BATCHES
    resumed = _weights(directory, "z3_resumed")
    _assert_close(resumed, _weights(directory, "z3_full"))
    _assert_close(resumed, _weights(directory, "ddp2"))  # incl. StepLR's second-epoch rate, restored


def test_accumulation_and_clipping_are_the_engines_and_match_ddp(trained):
    ranks, directory = trained
    # Lightning calls the engine's step every batch (it applies every second one) but counts applied steps
    assert ranks[0]["z2_accumulate"]["global_step"] == ranks[0]["ddp_accumulate"]["global_step"] == BATCHES
    _assert_close(_weights(directory, "z2_accumulate"), _weights(directory, "ddp_accumulate"))
    unclipped = _weights(directory, "ddp1")  # the same data without accumulation and clipping: differs
    assert not torch.allclose(unclipped["layer.weight"], _weights(directory, "z2_accumulate")["layer.weight"])


def test_a_single_file_checkpoint_loads_into_stage_3_with_load_full_weights(trained):
    ranks, directory = trained
    assert ranks[0]["full_weights"]["start_step"] == BATCHES
    _assert_close(_weights(directory, "full_weights"), _weights(directory, "ddp2"))


def test_predict_from_a_checkpoint_uses_its_weights(trained):
    ranks, directory = trained
    expected = _expected_predictions(_weights(directory, "z3"))
    for rank, result in enumerate(ranks):  # DistributedSampler: rank r gets samples r, r + 2, ...
        predicted = torch.cat(result["z3"]["predictions"])
        assert torch.allclose(predicted, expected[rank::2], atol=1e-6)


def test_a_two_rank_stage_3_checkpoint_loads_on_one_rank(trained):
    _, directory = trained
    [one] = spawn(1, run_cases, [("one", "predict", {"keywords": STAGE3_OFFLOAD, "devices": 1,
                                                     "ckpt_path": os.path.join(directory, "z3.ckpt")})], init=no_group)
    predicted = torch.cat(one["one"]["predictions"])
    assert torch.allclose(predicted, _expected_predictions(_weights(directory, "z3")), atol=1e-6)


@pytest.mark.parametrize("case, dtype", [("bf16", torch.bfloat16), ("fp16", torch.float16)])
def test_mixed_precision_trains_in_16_bits_and_the_loss_falls(trained, case, dtype):
    result = trained[0][0][case]
    assert result["weight_dtype"] == dtype  # compute weights; fp32 masters in the engine
    losses = [report["loss"] for report in result["reports"]]
    assert len(losses) == 3 * BATCHES  # the same batches each epoch
    assert sum(losses[-BATCHES:]) < 0.8 * sum(losses[:BATCHES]), losses


def test_each_optimizer_step_is_reported_with_loss_and_learning_rate(trained):
    ranks, _ = trained
    reports = ranks[0]["z3"]["reports"]
    assert [report["step"] for report in reports] == list(range(1, BATCHES + 1))
    assert [report["samples"] for report in reports] == [2 * step for step in range(1, BATCHES + 1)]
    assert all(report["lr"] == pytest.approx(0.1) and report["loss"] > 0 for report in reports)
    assert [report["lr"] for report in ranks[0]["z3_full"]["reports"][BATCHES:]] == [pytest.approx(0.01)] * BATCHES
    accumulated = ranks[0]["z2_accumulate"]["reports"]  # one report per applied step, not per batch
    assert [report["step"] for report in accumulated] == list(range(1, BATCHES + 1))
    assert [report["samples"] for report in accumulated] == [4 * step for step in range(1, BATCHES + 1)]


def test_setup_leaves_the_random_streams_where_ddp_leaves_them(trained):
    """Issue 35: BoringModel's dataset is drawn in train_dataloader, after setup; the strategy built that
    dataloader once more for its batch size and so moved torch's stream (0.290 for DDP's 0.176)."""
    ranks, directory = trained
    for result in ranks:
        assert result["streams_ddp"]["global_step"] == 10
        for stage in range(4):
            ours, ddp = result[f"streams_z{stage}"], result["streams_ddp"]
            assert moved_streams(ours["at_train_start"], ddp["at_train_start"]) == [], stage
            assert moved_streams(ours["at_end"], ddp["at_end"]) == [], stage
    expected = _weights(directory, "streams_ddp")
    for stage in range(4):
        _assert_close(_weights(directory, f"streams_z{stage}"), expected)


def test_a_resumed_fit_leaves_the_random_streams_where_ddp_leaves_them(trained):
    """Issue 35: `fit(ckpt_path=...)` of the issue's program, on to step 20 from the step-10 checkpoint.
    Lightning restores no random state on resume, under DDP or a strategy; loading rayzero's checkpoint
    (a stage-3 one with its offloaded optimizer) draws nothing, so the streams and the weights are DDP's."""
    ranks, directory = trained
    for result in ranks:
        ours, ddp = result["streams_z3_resumed"], result["streams_ddp_resumed"]
        assert ddp["global_step"] == ours["global_step"] == 20
        assert moved_streams(ours["at_train_start"], ddp["at_train_start"]) == []
        assert moved_streams(ours["at_end"], ddp["at_end"]) == []
    _assert_close(_weights(directory, "streams_z3_resumed"), _weights(directory, "streams_ddp_resumed"))


def test_a_planned_stop_saves_at_the_agreed_step_and_a_restart_resumes_by_itself(trained):
    ranks, directory = trained
    for result in ranks:
        stopped, resumed = result["stop"]["stopped"], result["stop"]["resumed"]
        assert result["stop"]["stop_committed"]
        # asked on rank 0 after step 3; both ranks stopped after step 4, with a Lightning checkpoint
        assert stopped["global_step"] == BATCHES and stopped["should_stop"] and stopped["context_should_stop"]
        assert stopped["files"] == [f"rayzero-stop-epoch=0-step={BATCHES}.ckpt"]
        assert stopped["validated"] >= 1  # Lightning's validation on stopping ran, not refused
        assert resumed["start_step"] == BATCHES and resumed["global_step"] == 2 * BATCHES
    assert os.path.isfile(os.path.join(directory, "run", f"global_step{BATCHES}", "manifest.json"))  # the engine's
    _assert_close(_weights(directory, "stop_1"), _weights(directory, "z3_full"))
