"""What the ranks of tests/dist/test_random_streams.py run: one program per way into rayzero, each also
under DDP, with the global random streams read after setup and after training (dropout draws in
every forward). Every case starts from the same seeds; the results are the streams' states."""
from __future__ import annotations

import json
import os
import random
import sys
from typing import Any

import numpy
import torch
from random_streams import random_states

STEPS = 3


def _seed_everything(seed: int = 0) -> None:
    random.seed(seed)
    numpy.random.seed(seed)
    torch.manual_seed(seed)


class DropoutNet(torch.nn.Module):
    """Dropout draws from torch's stream in every training forward: an extra or missing forward,
    or a stream moved at setup, changes the states after training."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.drop, self.norm, self.down = (torch.nn.Linear(8, 16), torch.nn.Dropout(0.3),
                                                    torch.nn.LayerNorm(16), torch.nn.Linear(16, 1))

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.drop(torch.relu(self.up(inputs)))))


def initialize_case(rank: int, zero: dict | None) -> dict[str, Any]:
    """`rayzero.initialize` (zero: the config's zero_optimization) or DistributedDataParallel (None)."""
    import rayzero

    _seed_everything()
    model = DropoutNet()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if zero is None:
        engine = torch.nn.parallel.DistributedDataParallel(model)
    else:
        engine, optimizer, _, _ = rayzero.initialize(model=model, optimizer=optimizer, config={
            "train_micro_batch_size_per_gpu": 4, "gradient_clipping": 0.0, "zero_optimization": zero})
    after_setup = random_states()
    for _ in range(STEPS):
        loss = engine(torch.randn(4, 8)).pow(2).mean()
        if zero is None:
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        else:
            engine.backward(loss)
            engine.step()
    if zero is not None:
        engine.close()
    return {"after_setup": after_setup, "after_training": random_states()}


def from_pretrained_case(rank: int, directory: str) -> dict[str, Any]:
    """rayzero's `from_pretrained` at stages 2 and 3 against transformers' own (which draws nothing for
    a complete checkpoint): the streams after loading."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

    from rayzero.integrations.transformers import from_pretrained

    path = os.path.join(directory, "pretrained")
    if rank == 0:
        torch.manual_seed(1)
        GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0,
                                   eos_token_id=0)).save_pretrained(path)
    torch.distributed.barrier()
    out = {}
    for name, stage in (("transformers", None), ("stage_2", 2), ("stage_3", 3)):
        _seed_everything()
        if stage is None:
            AutoModelForCausalLM.from_pretrained(path)
        else:
            from_pretrained(AutoModelForCausalLM, path, config={"zero_optimization": {"stage": stage}})
        out[name] = random_states()
    return out


def _gpt2():
    from transformers import AutoModelForCausalLM, GPT2Config

    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    return AutoModelForCausalLM.from_config(config)  # dropout 0.1 (GPT-2's default) in every block


def trainer_case(rank: int, directory: str, zero: dict | None) -> dict[str, Any]:
    """HF's Trainer: `--deepspeed ds.json` through rayzero's `deepspeed` (zero), or `--use_cpu
    --ddp_backend gloo` (None, plain DDP). The streams at on_train_begin and on_train_end."""
    from transformers import Trainer, TrainerCallback, TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    class Streams(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs) -> None:
            self.after_setup = random_states()

        def on_train_end(self, args, state, control, **kwargs) -> None:
            self.after_training = random_states()

    options: dict[str, Any] = {"use_cpu": True, "ddp_backend": "gloo"}
    if zero is not None:
        options = {"deepspeed": {
            "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": zero,
            "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                      "weight_decay": "auto"}}}}
    args = TrainingArguments(output_dir=os.path.join(directory, "trainer"), per_device_train_batch_size=2,
                             max_steps=STEPS, learning_rate=1e-2, seed=0, report_to="none", save_strategy="no",
                             dataloader_num_workers=0, disable_tqdm=True, **options)
    _seed_everything()
    model = _gpt2()
    tokens = torch.randint(0, 64, (4 * STEPS, 8), generator=torch.Generator().manual_seed(5))
    streams = Streams()
    trainer = Trainer(model=model, args=args, train_dataset=[{"input_ids": t, "labels": t} for t in tokens],
                      callbacks=[streams])
    trainer.train()
    engine = trainer.model_wrapped
    if zero is not None:
        engine.close()
    unset_hf_deepspeed_config()
    return {"after_setup": streams.after_setup, "after_training": streams.after_training,
            "trained_by": type(engine).__name__}


def accelerate_case(rank: int, directory: str, zero: dict | None) -> dict[str, Any]:
    """An Accelerate loop under the environment `accelerate launch --use_deepspeed --deepspeed_config_file`
    gives (what `rayzero run --config` sets: rayzero.workers.script), or `accelerate launch --cpu` (None,
    DDP). The streams after `prepare` and after training."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from accelerate.utils import set_seed

    from rayzero.workers.script import accelerate_environment

    AcceleratorState._reset_state(reset_partial_state=True)
    if zero is None:
        os.environ["ACCELERATE_USE_CPU"] = "true"
    else:
        config = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                  "zero_optimization": zero}
        os.environ.update(accelerate_environment(json.dumps(config), os.path.join(directory, f"accelerate{rank}")))
    set_seed(0)
    accelerator = Accelerator()
    inputs = torch.randn(4 * 2 * STEPS, 8)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(inputs, inputs[:, :1].tanh()), batch_size=4,
                                         shuffle=True)
    model = DropoutNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    after_setup = random_states()
    for batch_inputs, batch_targets in loader:
        accelerator.backward(torch.nn.functional.mse_loss(model(batch_inputs), batch_targets))
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
    if zero is not None:
        model.close()
    return {"after_setup": after_setup, "after_training": random_states(), "trained_by": type(model).__name__}


STAGE3_OFFLOAD = {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}
ZEROS = {"z0": {"stage": 0}, "z1": {"stage": 1}, "z2": {"stage": 2}, "z3": {"stage": 3}, "z3_offload": STAGE3_OFFLOAD}


def zero3_build_case(rank: int, directory: str) -> dict[str, Any]:
    """`from_config` after `TrainingArguments(deepspeed=<stage 3>)`: transformers builds under
    `deepspeed.zero.Init` and initialises on rank 0 only (`initialize_weights_zero3`), so the streams
    leave where a plain build leaves them; the deepspeed imported decides whose Init and gather run.
    The streams after the build and the weights (gathered, by name)."""
    import deepspeed
    from transformers import TrainingArguments
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    TrainingArguments(output_dir=os.path.join(directory, "zero3_build"), report_to="none", deepspeed={
        "train_micro_batch_size_per_gpu": "auto", "zero_optimization": {"stage": 3}})
    _seed_everything()
    model = _gpt2()
    states = random_states()
    weights = {}
    for name, param in model.named_parameters():
        with deepspeed.zero.GatheredParameters([param]):
            weights[name] = param.detach().clone()
    unset_hf_deepspeed_config()
    return {"after_build": states, "weights": weights, "deepspeed": deepspeed.__file__}


def deepspeed_zero3_build(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """zero3_build_case with DeepSpeed's own package (the oracle for run_cases' "zero3_build")."""
    import deepspeed

    deepspeed.init_distributed("gloo")
    return zero3_build_case(rank, directory)


def run_cases(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    """Every program, in the spawn's group (Accelerate and the Trainer take it as they find it); the
    environment is restored between the library cases."""
    from rayzero.compat import SITE_DIR

    sys.path.insert(0, SITE_DIR)  # what `rayzero run` does for a script: `import deepspeed` is rayzero's
    out: dict[str, Any] = {"initialize": {name: initialize_case(rank, zero)
                                          for name, zero in {"ddp": None, **ZEROS}.items()}}
    out["from_pretrained"] = from_pretrained_case(rank, directory)
    out["zero3_build"] = zero3_build_case(rank, directory)
    environment = dict(os.environ)
    for kind, case, zeros in (("accelerate", accelerate_case, ("z2", "z3")),
                              ("trainer", trainer_case, ("z2", "z3_offload"))):
        out[kind] = {}
        for name in ("ddp", *zeros):
            out[kind][name] = case(rank, directory, ZEROS.get(name))
            os.environ.clear()
            os.environ.update(environment)
    return out
