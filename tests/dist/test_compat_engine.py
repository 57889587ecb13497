"""`deepspeed.initialize` of rayzero's compatibility layer on 2 gloo ranks, as Accelerate and the HF
Trainer drive it ([Note: the DeepSpeed compatibility layer]): the boundary flag Accelerate sets
before every backward, DeepSpeed's config dict and save semantics, the ZeRO-3 16-bit state dict,
`zero_to_fp32`, and transformers' own ZeRO-3 model build (`from_config` / `from_pretrained` with
`is_deepspeed_zero3_enabled()`) through the compat `zero.Init` / `GatheredParameters`. Oracles: the
same engine counting micro steps itself, the checkpoint's own consolidation, transformers' plain
build. One spawn runs every case."""
from __future__ import annotations

import os
import sys
import tempfile

import pytest
import torch
from testkit.harness import build_model, global_batch, spawn

pytestmark = pytest.mark.dist
transformers = pytest.importorskip("transformers")

STEPS, MICRO = 3, 2


def _config(stage: int, **extra) -> dict:
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "zero_optimization": {"stage": stage},
            "steps_per_print": float("inf"), **extra}  # Accelerate writes inf ("never print")


def _micro_batch(rank: int, step: int, micro: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, targets = global_batch(step * 2 + micro, 2 * MICRO)
    return tokens[rank * MICRO:(rank + 1) * MICRO], targets[rank * MICRO:(rank + 1) * MICRO]


def _train(engine, rank: int, flagged: bool) -> None:
    """3 optimizer steps of 2 micro batches: counted by the engine, or flagged as Accelerate does."""
    for step in range(STEPS):
        for micro in range(2):
            boundary = micro == 1
            if flagged:
                engine.set_gradient_accumulation_boundary(boundary)
            engine.backward(engine(*_micro_batch(rank, step, micro)))
            if boundary or not flagged:  # Accelerate calls step() only at a boundary
                engine.step()


def _gpt2_config():
    return transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


def _cases(rank: int, world: int, directory: str) -> dict:
    from rayzero.compat import SITE_DIR

    sys.path.insert(0, SITE_DIR)  # what `rayzero run` does for a script
    import deepspeed
    from deepspeed.utils.zero_to_fp32 import (
        convert_zero_checkpoint_to_fp32_state_dict,
        get_fp32_state_dict_from_zero_checkpoint,
        load_state_dict_from_zero_checkpoint,
    )

    out: dict = {}
    counted, _, _, _ = deepspeed.initialize(model=build_model(), config_params=_config(2))
    flagged, _, _, _ = deepspeed.initialize(model=build_model(), config_params=_config(2))
    _train(counted, rank, flagged=False)
    _train(flagged, rank, flagged=True)
    out["boundary_flag_same_weights"] = all(
        torch.equal(a, b) for a, b in zip(counted.module.state_dict().values(), flagged.module.state_dict().values()))
    out["steps"] = (counted.global_steps, flagged.global_steps)
    out["is_module"] = isinstance(flagged, torch.nn.Module) and isinstance(flagged, deepspeed.DeepSpeedEngine)
    out["config_view"] = (flagged.config.get("zero_optimization", {}).get("stage"), "steps_per_print" in flagged.config,
                          flagged.config["train_micro_batch_size_per_gpu"])
    out["state_dict_prefix"] = next(iter(flagged.state_dict())).split(".")[0]
    with pytest.raises(ValueError, match="ZeRO-3"):
        flagged._zero3_consolidated_16bit_state_dict()
    counted.close()
    flagged.close()

    engine, _, _, _ = deepspeed.initialize(model=build_model(), config_params=_config(
        3, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": 0,
                              "stage3_gather_16bit_weights_on_model_save": True}))
    _train(engine, rank, flagged=True)
    save_dir = os.path.join(directory, "checkpoint-3")
    engine.save_checkpoint(save_dir)
    # DeepSpeed's semantics: committed on return (the Trainer writes its files beside it at once)
    out["committed_on_return"] = os.path.isfile(os.path.join(save_dir, "global_step3", "manifest.json"))
    state = engine._zero3_consolidated_16bit_state_dict()
    out["gather_flag"] = engine.zero_gather_16bit_weights_on_model_save()
    if rank == 0:
        full = get_fp32_state_dict_from_zero_checkpoint(save_dir)
        out["consolidated_equals_checkpoint"] = sorted(name for name in full if not torch.equal(full[name], state[name]))
        out["tie_kept"] = state["head.weight"] is state["embed.weight"]
        out["names"] = sorted(state) == sorted(build_model().state_dict())
        files = convert_zero_checkpoint_to_fp32_state_dict(save_dir, os.path.join(directory, "fp32"), max_shard_size=600,
                                                           safe_serialization=True)
        from safetensors.torch import load_file

        merged = {}
        for name in files[:-1]:
            merged.update(load_file(os.path.join(directory, "fp32", name)))
        out["sharded"] = (len(files) > 2, files[-1], sorted(n for n in full if not torch.equal(merged[n], full[n])))
        fresh = load_state_dict_from_zero_checkpoint(build_model(seed=5), save_dir)
        out["loaded"] = sorted(n for n, t in fresh.state_dict().items() if not torch.equal(t, full[n]))
    else:
        out["other_rank_gets_none"] = state is None
    engine.close()
    out["hf"] = _transformers_zero3_build(rank, directory)
    out["trainer_arguments"] = _trainer_arguments(rank, directory)
    return out


GUIDE_ZERO3 = {  # the HF DeepSpeed guide's ZeRO-3 file, every "auto" in it
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto", "steps_per_print": 2000,
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "wall_clock_breakdown": False,
}


def _trainer_arguments(rank: int, directory: str) -> dict:
    """`TrainingArguments(deepspeed=...)` on a machine without accelerators, in a group the script
    formed itself: Accelerate's state counts both processes (DeepSpeed 0.19.8 counts one, rank 0, on
    every rank), and the config HF fills from TrainingArguments reaches rayzero fully resolved, with
    nothing for rayzero's validation to resolve, warn about or refuse."""
    from rayzero.compat.engine import translate_in_process_values
    from rayzero.config import load_config

    args = transformers.TrainingArguments(output_dir=os.path.join(directory, "trainer"), deepspeed=GUIDE_ZERO3,
                                          per_device_train_batch_size=3, gradient_accumulation_steps=2,
                                          learning_rate=3e-4, warmup_steps=2, report_to="none")
    model = transformers.GPT2LMHeadModel(_gpt2_config())
    hf_config = args.hf_deepspeed_config
    hf_config.trainer_config_finalize(args, model, 10)
    # what reaches rayzero: HF's filled config, as deepspeed.initialize hands it on
    resolved = load_config(translate_in_process_values(hf_config.config), world_size=args.world_size)
    return {"world": (args.world_size, args.process_index, args.local_process_index, str(args.parallel_mode)),
            "unresolved": resolved.unresolved_autos(), "notes": [n for n in resolved.notes if not n.startswith("auto:")],
            "batch": (resolved.train_batch_size, resolved.train_micro_batch_size_per_gpu,
                      resolved.gradient_accumulation_steps),
            "scheduler": dict(resolved.scheduler.params), "bucket": resolved.zero_optimization.reduce_bucket_size}


def _transformers_zero3_build(rank: int, directory: str) -> dict:
    """transformers' ZeRO-3 path (HfDeepSpeedConfig alive => is_deepspeed_zero3_enabled()), against
    transformers' plain build: from_config initialises like `no_init_weights` + `initialize_weights()`
    from the same seed; from_pretrained gives the saved weights."""
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, is_deepspeed_zero3_enabled

    from rayzero.compat.zero import GatheredParameters
    from rayzero.engine.stage3.parameters import lookup
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # transformers 4.x
        from transformers.modeling_utils import no_init_weights

    torch.manual_seed(0)
    with no_init_weights():
        reference = transformers.GPT2LMHeadModel(_gpt2_config())
    reference.initialize_weights()
    reference.tie_weights()
    pretrained_dir = os.path.join(directory, "pretrained")
    if rank == 0:
        reference.save_pretrained(pretrained_dir)
    torch.distributed.barrier()
    keep_alive = HfDeepSpeedConfig({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": 1})
    out = {"zero3_enabled": is_deepspeed_zero3_enabled()}
    expected = dict(reference.named_parameters())
    for how in ("from_config", "from_pretrained"):
        torch.manual_seed(0)
        if how == "from_config":
            model = transformers.AutoModelForCausalLM.from_config(_gpt2_config())
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(pretrained_dir)
        params = dict(model.named_parameters())
        with GatheredParameters(list(params.values())):
            out[how] = {"partitioned": all(lookup(p) is not None for p in params.values()),
                        "mismatch": sorted(n for n, p in params.items() if not torch.equal(p.detach(), expected[n]))}
    del keep_alive
    return out


def test_compat_engine_as_accelerate_and_the_trainer_drive_it():
    with tempfile.TemporaryDirectory() as directory:
        ranks = spawn(2, _cases, directory)
    for rank, out in enumerate(ranks):
        assert out["boundary_flag_same_weights"], "set_gradient_accumulation_boundary changed the training"
        assert out["steps"] == (STEPS, STEPS)
        assert out["is_module"] and out["config_view"] == (2, False, MICRO)
        assert out["state_dict_prefix"] == "module"  # DeepSpeed's engine holds the model as `module`
        assert out["committed_on_return"] and out["gather_flag"]
        assert out["hf"]["zero3_enabled"]
        for how in ("from_config", "from_pretrained"):
            assert out["hf"][how] == {"partitioned": True, "mismatch": []}, (rank, how)
        filled = out["trainer_arguments"]
        assert filled["world"] == (2, rank, rank, "ParallelMode.DISTRIBUTED")
        assert filled["unresolved"] == [] and filled["notes"] == []
        assert filled["batch"] == (3 * 2 * 2, 3, 2)
        assert filled["scheduler"] == {"warmup_min_lr": 0, "warmup_max_lr": 3e-4, "warmup_num_steps": 2}
        assert filled["bucket"] == 32 * 32  # HF's hidden_size * hidden_size
    first, second = ranks
    assert first["consolidated_equals_checkpoint"] == [] and first["tie_kept"] and first["names"]
    assert first["sharded"] == (True, "model.safetensors.index.json", [])
    assert first["loaded"] == []
    assert second["other_rank_gets_none"]
