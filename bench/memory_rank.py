"""What runs inside each spawned rank of bench/memory.py: one system, one model, its memory measured.

The rank settles to a baseline that every system pays alike (`settle`), then builds transformers'
GPT2LMHeadModel (fp32, random init from a fixed seed), hands it and a torch AdamW over its
parameters to the system, trains `steps` steps on batches fixed by (step, rank), and reports the
kernel's high-water mark of resident memory (VmHWM, reset to the baseline by `/proc/self/clear_refs`)
after each phase: build, setup, each step. One more step (the probe) takes a census of the tensors
alive between its backward and its optimizer step (bench/census.py), so a row says where its memory
went; the peak is read before the probe, so the census's own work cannot move it.
"""
from __future__ import annotations

import collections
import ctypes
import datetime
import importlib
import json
import os
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from bench import census
from bench.engine_systems import engine_config

SEED = 1234
LEARNING_RATE = 1e-4
WEIGHT_DECAY = 0.01
MMAP_THRESHOLD = 131072
"""glibc's mmap threshold, fixed (mallopt, as MALLOC_MMAP_THRESHOLD_ would): a freed block larger
than this goes back to the kernel at once, so resident memory is what is live, the same for every
system (glibc's dynamic threshold would keep some freed blocks of some systems in its heap)."""

# name -> GPT2Config keyword arguments. "gpt2" is GPT-2 small as released (124M); "small" keeps its
# shape at a size that runs in seconds (for trying the harness, not for figures).
MODELS: dict[str, dict[str, int]] = {
    "gpt2": {"n_layer": 12, "n_embd": 768, "n_head": 12, "vocab_size": 50257, "n_positions": 1024},
    "small": {"n_layer": 4, "n_embd": 256, "n_head": 4, "vocab_size": 8192, "n_positions": 256},
    "tiny": {"n_layer": 1, "n_embd": 64, "n_head": 2, "vocab_size": 256, "n_positions": 32},
}
"""`tiny`: the warm-up's model (`settle`)."""
LLAMA_MODELS: dict[str, dict[str, Any]] = {
    "llama": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12,
              "num_key_value_heads": 4, "vocab_size": 32000, "max_position_embeddings": 1024,
              "tie_word_embeddings": False},
}
"""A Llama-shaped model of GPT-2 small's width and depth (125M): RMSNorm, SwiGLU MLP, grouped-query
attention, rotary positions and an untied head, none of which GPT-2 has."""


def vocabulary(size: str) -> int:
    return (LLAMA_MODELS.get(size) or MODELS[size])["vocab_size"]


class CausalLM(torch.nn.Module):
    """transformers' GPT2LMHeadModel (or LlamaForCausalLM) returning its loss, so every system calls
    `loss = model(tokens, labels)`. Dropout is off, so the systems' losses differ only by their numerics."""

    def __init__(self, size: str) -> None:
        super().__init__()
        if size in LLAMA_MODELS:
            from transformers import LlamaConfig, LlamaForCausalLM

            self.lm = LlamaForCausalLM(LlamaConfig(**LLAMA_MODELS[size], attention_dropout=0.0))
            return
        from transformers import GPT2Config, GPT2LMHeadModel

        last = MODELS[size]["vocab_size"] - 1  # GPT-2's <|endoftext|> is its last token
        config = GPT2Config(**MODELS[size], resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                            bos_token_id=last, eos_token_id=last)
        self.lm = GPT2LMHeadModel(config)

    def blocks(self) -> list[torch.nn.Module]:
        """The transformer blocks (FSDP2's units)."""
        return list(self.lm.model.layers if hasattr(self.lm, "model") else self.lm.transformer.h)

    def forward(self, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, labels=labels).loss  # labels are shifted inside


def gpt2() -> CausalLM:
    """For `rayzero estimate --model bench.memory_rank:gpt2` (and count_model)."""
    return CausalLM("gpt2")


def small() -> CausalLM:
    return CausalLM("small")


def llama() -> CausalLM:
    return CausalLM("llama")


def build_model(size: str) -> CausalLM:
    with torch.random.fork_rng():
        torch.manual_seed(SEED)
        return CausalLM(size)


def batch(size: str, step: int, rank: int, batch_size: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s tokens for `step` (inputs and labels are the same tokens: GPT-2 shifts)."""
    generator = torch.Generator().manual_seed(SEED * 1_000_003 + step * 1009 + rank)
    tokens = torch.randint(0, vocabulary(size), (batch_size, length), generator=generator)
    return tokens, tokens


def adamw(parameters) -> torch.optim.Optimizer:
    """The one optimizer every system gets: torch's AdamW, its fused CPU kernel."""
    return torch.optim.AdamW(parameters, lr=LEARNING_RATE, weight_decay=WEIGHT_DECAY, fused=True)


# ---- systems: (model, stage, precision, micro batch) -> (step function, modules for the census) --
Step = Callable[[torch.Tensor, torch.Tensor, Callable[[], None] | None], torch.Tensor]
"""One training step; the callback (the probe's census) runs between backward and the optimizer step."""


def _engine_step(engine) -> Step:
    def step(tokens, labels, between=None):
        loss = engine(tokens, labels)
        engine.backward(loss)
        if between is not None:
            between()
        engine.step()
        return loss
    return step


def _config(stage: int, precision: str, micro_batch: int, extra: dict[str, Any]) -> dict[str, Any]:
    """bench/engine_systems.py's DeepSpeed config (less its optimizer: the client AdamW is used),
    bf16 on for bf16 rows, `extra` (bench/memory.py --set) on top: its zero_optimization key by key."""
    extra = {"zero_optimization": {}, **extra}
    if precision == "bf16":
        extra = {"bf16": {"enabled": True}, **extra}
    return engine_config(stage, micro_batch, extra)


def _rayzero(model, stage: int, precision: str, micro_batch: int, extra: dict[str, Any]) -> Step:
    import rayzero

    engine, _, _, _ = rayzero.initialize(model=model, optimizer=adamw(model.parameters()),
                                         config=_config(stage, precision, micro_batch, extra))
    return _engine_step(engine)


def _deepspeed(model, stage: int, precision: str, micro_batch: int, extra: dict[str, Any]) -> Step:
    import deepspeed
    import deepspeed.ops

    # As bench/engine_systems.py: no native op is needed with a client optimizer, and marking them
    # unavailable skips DeepSpeed's compile probes (no collective changes).
    deepspeed.ops.__dict__.setdefault("__compatible_ops__", collections.defaultdict(bool))
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=adamw(model.parameters()),
                                           config=_config(stage, precision, micro_batch, extra))
    return _engine_step(engine)


def _fsdp2(model, stage: int, precision: str, micro_batch: int, extra: dict[str, Any]) -> Step:
    """fully_shard per transformer block, then the root (embeddings and the tied head); bf16:
    bf16 parameters in compute, fp32 gradient reduction (FSDP2's usual mixed precision)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    for block in model.blocks():
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = adamw(model.parameters())

    def step(tokens, labels, between=None):
        loss = model(tokens, labels)
        loss.backward()
        if between is not None:
            between()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss
    return step


BUILDERS = {"rayzero": _rayzero, "deepspeed": _deepspeed, "fsdp2": _fsdp2}


def parse_system(system: str) -> tuple[str, int, str]:
    """"rayzero-stage3-bf16" -> ("rayzero", 3, "bf16"); "fsdp2-bf16" -> ("fsdp2", 3, "bf16")."""
    family, *middle, precision = system.split("-")
    stage = int(middle[0].removeprefix("stage")) if middle else 3
    return family, stage, precision


# ---- memory readings --------------------------------------------------------------------------
def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


SYSTEM_MODULES = ("deepspeed.runtime.bf16_optimizer", "deepspeed.runtime.zero.stage3",
                  "deepspeed.runtime.zero.stage_1_and_2", "torch.distributed.fsdp", "rayzero.engine.api",
                  "rayzero.engine.bucketed.stage1", "rayzero.engine.bucketed.stage2", "rayzero.engine.stage3.strategy")
"""Every system's modules, imported before the baseline whichever system the row runs."""


def settle() -> None:
    """Bring the rank to a baseline every system pays alike, so the peak above it is the system's.

    As tests/dist/test_fidelity_memory.py's `_settle` (its docstring has the measurements behind
    each part): every system's modules imported (rayzero's engine, DeepSpeed's ZeRO optimizers,
    FSDP2, transformers' GPT-2); a warm-up step of a tiny GPT-2 in fp32 and in bf16 with the fused
    AdamW (torch._dynamo's import, the kernels' first-use buffers); one of each collective the
    systems use; then every page of every mapped file mapped in (MADV_POPULATE_READ), so code first
    run after the baseline does not count as the system's memory."""
    for module in SYSTEM_MODULES:
        importlib.import_module(module)
    for dtype in (torch.float32, torch.bfloat16):
        model = build_model("tiny").to(dtype)
        optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, fused=True)
        model(*batch("tiny", 0, 0, 2, 8)).backward()
        optimizer.step()
        world = dist.get_world_size()
        flat = torch.ones(8 * world, dtype=dtype)
        dist.all_reduce(flat)
        dist.reduce_scatter_tensor(torch.empty(8, dtype=dtype), flat)
        dist.all_gather_into_tensor(flat, torch.ones(8, dtype=dtype))
        dist.broadcast(flat, 0)
        del model, optimizer, flat
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) >= 6 and fields[5].startswith("/"):
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                libc.madvise(start, end - start, 22)  # MADV_POPULATE_READ


def measure(job: dict[str, Any], rank: int) -> dict[str, Any]:
    family, stage, precision = parse_system(job["system"])
    settle()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # VmHWM := VmRSS: the peak is measured from here
    base_kib, file_base_kib = _status_kib("VmRSS"), _status_kib("RssFile")

    def grown() -> int:
        return (_status_kib("VmHWM") - base_kib) * 1024

    out: dict[str, Any] = {"baseline_rss_bytes": base_kib * 1024, "phases": {}}
    model = build_model(job["model"])
    out["phases"]["build"] = grown()
    step = BUILDERS[family](model, stage, precision, job["batch"], job["config"])
    out["phases"]["setup"] = grown()
    losses = []
    for index in range(job["steps"]):
        losses.append(float(step(*batch(job["model"], index, rank, job["batch"], job["length"])).detach()))
        out["phases"][f"step{index + 1}"] = grown()
    out["peak_growth_bytes"] = grown()
    out["file_backed_growth_bytes"] = (_status_kib("RssFile") - file_base_kib) * 1024
    found: list[census.Census] = []
    step(*batch(job["model"], job["steps"], rank, job["batch"], job["length"]),
         lambda: found.append(census.take([model], resident=True)))
    out["census_bytes"] = {"total": found[0].total, **found[0].by_kind_dtype}
    out["census_resident_bytes"] = {"total": sum(found[0].resident_by_kind_dtype.values()),
                                    **found[0].resident_by_kind_dtype}
    out["losses"] = losses
    return out


def worker(rank: int, job: dict[str, Any], port: int, out_dir: str) -> None:
    """Entry point of one spawned rank: measure, write rank{rank}.json (or the error) in `out_dir`."""
    libc = ctypes.CDLL(None)
    libc.mallopt(-3, MMAP_THRESHOLD)  # M_MMAP_THRESHOLD: first, before the rank allocates its own
    log = os.open(os.path.join(out_dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)  # DeepSpeed logs a lot: kept per rank, quoted in an error row
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(job["world_size"]), LOCAL_WORLD_SIZE=str(job["world_size"]))
    torch.set_num_threads(1)  # every system gets the same one thread per rank
    result: dict[str, Any]
    try:
        dist.init_process_group("gloo", rank=rank, world_size=job["world_size"],
                                timeout=datetime.timedelta(seconds=job["collective_timeout_s"]))
        result = measure(job, rank)
    except Exception as error:  # noqa: BLE001 - a failing system is a row, not a crashed benchmark
        result = {"error": f"{type(error).__name__}: {error}"[:2000], "traceback": traceback.format_exc()[-4000:]}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as handle:
        json.dump(result, handle)
    if dist.is_initialized():
        dist.destroy_process_group()
