"""What the ranks of tests/dist/test_path_hf.py run: HF checkpoints into ZeRO-3 partitions and out."""
from __future__ import annotations

import gc
import os

import torch
import torch.distributed as dist

STAGE3 = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 0.0,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": {"stage": 3, "stage3_gather_16bit_weights_on_model_save": True,
                                "stage3_param_persistence_threshold": 0}}


def tiny_config(width: int = 32, layers: int = 2, vocab: int = 64):
    from transformers import GPT2Config

    return GPT2Config(n_layer=layers, n_embd=width, n_head=2, vocab_size=vocab, n_positions=16,
                      bos_token_id=0, eos_token_id=0)


def _vm(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


def _full_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    import rayzero

    state = {}
    for name, param in model.named_parameters():
        with rayzero.zero.GatheredParameters(param):
            state[name] = param.detach().clone()
    return state


def _same(ours: dict[str, torch.Tensor], reference: torch.nn.Module) -> list[str]:
    expected = dict(reference.named_parameters())
    return [name for name, value in ours.items() if not torch.equal(value, expected[name].detach())]


def _return_freed_memory_to_the_os() -> None:
    """glibc raises its mmap threshold as large blocks are freed, after which freed tensors stay in
    the heap and in RSS; a fixed threshold makes RSS follow what is actually held."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6")
    libc.mallopt(-3, 64 * 1024)  # M_MMAP_THRESHOLD: fixed, so the dynamic adjustment is off
    libc.mallopt(-1, 128 * 1024)  # M_TRIM_THRESHOLD


def worker(rank: int, world: int, payload: dict) -> dict:
    _return_freed_memory_to_the_os()
    from transformers import GPT2LMHeadModel

    import rayzero
    from rayzero.integrations.transformers import from_pretrained

    root = payload["dir"]
    single, sharded, big = (os.path.join(root, name) for name in ("single", "sharded", "big"))
    if rank == 0:
        torch.manual_seed(0)
        model = GPT2LMHeadModel(tiny_config())
        model.save_pretrained(single)
        model.save_pretrained(sharded, max_shard_size="20KB")  # several files + the index
        big_model = GPT2LMHeadModel(tiny_config(width=payload["big_width"], layers=4, vocab=256))
        big_model.save_pretrained(big)
        from transformers import LlamaConfig, LlamaForCausalLM

        llama_config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64, max_position_embeddings=32)
        LlamaForCausalLM(llama_config).save_pretrained(os.path.join(root, "llama"))
        del model, big_model
        gc.collect()
    dist.barrier()
    out: dict = {"sharded_files": sorted(os.listdir(sharded))}

    reference = GPT2LMHeadModel.from_pretrained(single)
    for name, path in (("single", single), ("sharded", sharded)):
        model = from_pretrained(GPT2LMHeadModel, path, config=STAGE3)
        out[f"{name}_mismatched"] = _same(_full_state(model), reference)
        out[f"{name}_partitioned"] = all(param.numel() == 0 for param in model.parameters())

    # A model with buffers computed at construction (rotary inv_freq), not stored in the checkpoint
    from transformers import LlamaForCausalLM

    llama_reference = LlamaForCausalLM.from_pretrained(os.path.join(root, "llama"))
    llama = from_pretrained(LlamaForCausalLM, os.path.join(root, "llama"), config=STAGE3)
    out["llama_mismatched"] = _same(_full_state(llama), llama_reference)
    expected_buffers = dict(llama_reference.named_buffers())
    out["llama_buffers"] = {name: torch.equal(value, expected_buffers[name]) for name, value in llama.named_buffers()}

    # Peak memory of loading the big model, from a reset high-water mark (Linux clear_refs 5).
    gc.collect()
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _vm("VmRSS")
    model = from_pretrained(GPT2LMHeadModel, big, config=STAGE3)
    out["big_peak_growth"] = _vm("VmHWM") - before
    out["big_model_bytes"] = sum(param_numel(p) for p in model.parameters()) * 4
    del model
    gc.collect()

    # Out: train one step from the pretrained weights, then save_16bit_model and a checkpoint.
    model = from_pretrained(GPT2LMHeadModel, single, config=STAGE3)
    engine, _, _, _ = rayzero.initialize(model=model, config=STAGE3)
    torch.manual_seed(1 + rank)
    ids = torch.randint(0, 64, (2, 8))
    loss = engine(ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    engine.save_16bit_model(os.path.join(root, "out16"), "model.safetensors")
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    engine.wait_for_checkpoint()
    out["trained"] = _full_state(model)
    return out


def param_numel(param: torch.nn.Parameter) -> int:
    from rayzero.engine.stage3.parameters import lookup

    found = lookup(param)
    return found[1].numel if found is not None else param.numel()
