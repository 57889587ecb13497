"""A module's floating buffers under fp16/bf16: DeepSpeed 0.19.8's `data_types.buffer_dtype` and
`data_types.keep_in_fp32_modules`.

[Note: buffers keep their dtype]
Parameters compute in the fp16/bf16 mode's dtype; buffers are not parameters. A rotary embedding's
`inv_freq` (Llama, Mistral, Qwen, ...) is computed in fp32 and used in fp32: cast to bf16 it moves
the positions' angles, and the loss with them. rayzero cast every floating buffer to the compute
dtype, as DeepSpeed's engine did with `module.bfloat16()`: on a Llama-shaped 125M model the first
step's loss differed from FSDP2's (which keeps buffers as built) and from DeepSpeed 0.19.8's by 6e-4
(bench/memory.py --model llama). DeepSpeed 0.19.8 casts parameters only, as FSDP2's
`MixedPrecisionPolicy` does:
- `buffer_dtype` unset: every floating buffer keeps the dtype it was built or loaded in;
  `buffer_dtype` set: floating buffers are cast to it.
- `keep_in_fp32_modules` ("auto": the model's transformers lists `_keep_in_fp32_modules_strict`,
  and `_keep_in_fp32_modules` under fp16; or name patterns; or []) names buffers kept in fp32
  either way, put back to fp32 when they arrive in 16 bits.
One departure, where DeepSpeed fails: a batch norm's running statistics follow its parameters'
dtype when `buffer_dtype` is unset, because torch's batch_norm takes them in the input's dtype only
("expected scalar type BFloat16 but found Float" under DeepSpeed 0.19.8's default).
A model whose forward mixes an fp32 buffer into 16-bit activations (`h * self.scale`) fails there
with torch's dtype error, as under DeepSpeed 0.19.8 and FSDP2; the engine adds a note to that error
naming the fp32 buffers and the key that casts them (`mixed_dtype_note`).
tests/dist/test_buffer_dtypes.py checks each case against DeepSpeed 0.19.8's engine.
"""
from __future__ import annotations

import re
from typing import Any

import torch
from torch.nn.modules.batchnorm import _NormBase

AUTO = "auto"


def keep_in_fp32_pattern(module: torch.nn.Module, setting: Any, dtype: torch.dtype) -> re.Pattern | None:
    """The names of `module`'s tensors to keep in fp32 under `dtype`, as DeepSpeed 0.19.8 matches
    them (transformers' glob rule: `*` any characters, found anywhere in the full name); None: none."""
    if dtype not in (torch.float16, torch.bfloat16):
        return None
    if setting is None or setting == AUTO:
        patterns = set()
        for module_name, child in module.named_modules():
            names = set(getattr(child, "_keep_in_fp32_modules_strict", None) or [])
            if dtype == torch.float16:
                names |= set(getattr(child, "_keep_in_fp32_modules", None) or [])
            for name in names:
                pattern = name.replace("*", ".*")
                patterns.add(rf"^{re.escape(module_name)}\..*{pattern}" if module_name else pattern)
    else:
        patterns = {name.replace("*", ".*") for name in setting}
    return re.compile("|".join(sorted(patterns))) if patterns else None


def _running_statistics(module: torch.nn.Module) -> set[int]:
    return {id(buffer) for child in module.modules() if isinstance(child, _NormBase) and child.track_running_stats
            for buffer in (child.running_mean, child.running_var) if buffer is not None}


def place_buffers(module: torch.nn.Module, compute_dtype: torch.dtype, buffer_dtype: torch.dtype | None,
                  keep_in_fp32: Any, device: torch.device | None = None) -> None:
    """Each floating buffer of `module` in the dtype [Note: buffers keep their dtype] gives it (and on
    `device`, when given; other buffers stay as they are): `buffer_dtype`, fp32 for the names kept in
    fp32, else as it is (a batch norm's running statistics: `compute_dtype`)."""
    keep = keep_in_fp32_pattern(module, keep_in_fp32, compute_dtype)
    statistics = _running_statistics(module) if buffer_dtype is None else set()
    for module_name, owner in module.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, buffer in list(owner.named_buffers(recurse=False)):
            if buffer is None or not buffer.is_floating_point():
                continue
            if keep is not None and keep.search(prefix + name):
                dtype = torch.float32
            elif buffer_dtype is not None:
                dtype = buffer_dtype
            elif id(buffer) in statistics:
                dtype = compute_dtype
            else:
                dtype = buffer.dtype
            setattr(owner, name, buffer.to(device if device is not None else buffer.device, dtype))


def mixed_dtype_note(module: torch.nn.Module, compute_dtype: torch.dtype, buffer_dtype: torch.dtype | None,
                     error: BaseException) -> str | None:
    """What to tell a user whose forward failed on a dtype mismatch while fp32 buffers sit beside
    16-bit parameters ([Note: buffers keep their dtype]); None when that is not the case."""
    text = str(error)
    if buffer_dtype is not None or compute_dtype == torch.float32 or not (
            "dtype" in text or "scalar type" in text):
        return None
    kept = [name for name, buffer in module.named_buffers() if buffer is not None and buffer.dtype == torch.float32]
    if not kept:
        return None
    name = {torch.bfloat16: "bf16", torch.float16: "fp16"}[compute_dtype]
    shown = ", ".join(kept[:3]) + (f" and {len(kept) - 3} more" if len(kept) > 3 else "")
    return (f"rayzero: under {name} the model's floating buffers keep their dtype, as DeepSpeed 0.19.8 and FSDP2 "
            f"keep them, and these are fp32: {shown}. If the forward mixes one of them with {name} activations, "
            f'set "data_types": {{"buffer_dtype": "{name}"}} in the config to cast them (what rayzero did before), '
            f"or cast the buffer where the forward uses it ([Note: buffers keep their dtype])")
