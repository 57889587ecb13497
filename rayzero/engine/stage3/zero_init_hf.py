"""`rayzero.zero.Init` around a Hugging Face model: initial values from the model's own `_init_weights`.

[Note: Hugging Face models under zero.Init]
A `PreTrainedModel` does not initialise itself module by module: its modules' constructors draw
values (some, like GPT-2's `Conv1D`, with no `reset_parameters()` to replay), then `post_init()`
re-initialises every module through `_init_weights` (normal(0, initializer_range), zero biases,
GPT-2's `c_proj` scaled by 1/sqrt(2·n_layer), set by the *parent* module on its child's weight).
Built on the meta device, transformers skips that pass (`init_weights` returns early on meta), so
neither torch's defaults nor the constructors' values are what the model trains from.

Transformers' own ZeRO-3 path (`from_config` under DeepSpeed, `initialize_weights_zero3`) builds
with initialisation off, then walks the module tree children first (`smart_apply`: a nested
`PreTrainedModel` dispatches its own `_initialize_weights`) and, per module, gathers the
module's parameters and its direct children's, runs `_initialize_weights(module)` on rank 0 and
scatters the result. This replays exactly that walk: each module's own meta parameters and buffers
get full temporaries (NaN-filled), the module's initialiser runs, and a temporary is broadcast
from rank 0 and partitioned once the last module that may touch it (its owner's parent) is done.
transformers initialises a model *before* tying it (`init_weights`: initialise, then tie), so a
tied parameter gets one temporary per module holding it, every one drawn as if untied, and the
value kept is its creator's (the tie's source, e.g. the input embedding). Same seed => the same
values as transformers building the model with initialisation off and running
`initialize_weights()` (tested), which is the order DeepSpeed's path draws in on rank 0.
A module whose every value `_init_weights` leaves unset (transformers 4.x's default
`_init_weights` does nothing) gets its constructor's initialisation, `reset_parameters()`, when
it has one. A value still unset keeps the value its constructor registered when
it is a vector (transformers 4.x leaves a Llama RMSNorm's ones to the constructor; vectors are
kept as registered because they are small); a matrix is an error naming it, since its
constructor's initialisation ran on the meta stand-in; `param_init_fn` is the way out.
"""
from __future__ import annotations

import contextlib
import inspect
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from rayzero.config.errors import RayZeroValueError

Held = tuple[torch.nn.Module, str, dict, str, torch.Tensor, torch.Tensor]
"""(holding module, "parameter" or "buffer", the dict holding it, its name there, the meta tensor,
its full temporary in that module)."""

if TYPE_CHECKING:
    from rayzero.engine.stage3.zero_init import Init


def is_pretrained(module: torch.nn.Module) -> bool:
    """A transformers `PreTrainedModel` (transformers is imported only by a program that built one)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def _guard() -> contextlib.AbstractContextManager:
    """transformers' guard that makes torch.nn.init respect `_is_hf_initialized`, as it runs inits."""
    initialization = sys.modules.get("transformers.initialization")
    guard = getattr(initialization, "guard_torch_init_functions", None)
    return guard() if guard is not None else contextlib.nullcontext()


def _post_order(root: torch.nn.Module) -> list[tuple[torch.nn.Module, torch.nn.Module]]:
    """(module, the PreTrainedModel whose `_initialize_weights` initialises it), children first."""
    out: list[tuple[torch.nn.Module, torch.nn.Module]] = []

    def visit(module: torch.nn.Module, owner: torch.nn.Module) -> None:
        for child in module.children():
            visit(child, child if is_pretrained(child) else owner)
        out.append((module, owner))
    visit(root, root)
    return out


def _initializer(owner: torch.nn.Module, is_custom_code: bool) -> Callable[[torch.nn.Module], None]:
    """`owner._initialize_weights` as transformers calls it (5.x passes `is_custom_code`, 4.x not)."""
    initialize = owner._initialize_weights
    if "is_custom_code" in inspect.signature(initialize).parameters:
        return lambda module: initialize(module, is_custom_code)
    return initialize


def _state(module: torch.nn.Module) -> list[tuple[str, dict, str, torch.Tensor]]:
    """(kind, the dict holding it, name, tensor) for the module's own meta parameters and buffers."""
    return [(kind, slots, name, tensor) for kind, slots in (("parameter", module._parameters),
                                                            ("buffer", module._buffers))
            for name, tensor in slots.items() if tensor is not None and tensor.is_meta]


def materialize_hf(init: Init, root: torch.nn.Module, creator: dict[int, tuple[torch.nn.Module, str]],
                   registered: dict[int, torch.Tensor]) -> None:
    """Give `root`'s meta parameters and buffers values from its `_init_weights`, partitioned.
    `creator`: id(parameter) -> (module, name) that created it (a tie's source); `registered`:
    id(parameter) -> a vector parameter's value when its constructor registered it."""
    order = _post_order(root)
    # Which module is the last to touch each meta tensor: its holders and their parents.
    last: dict[int, int] = {}
    for index, (module, _) in enumerate(order):
        for holder in (module, *module.children()):
            for _, _, _, tensor in _state(holder):
                last[id(tensor)] = index
    # Per holder, a temporary of its own: transformers initialises a model before tying it, so a
    # tied parameter takes the values its creator's init drew (the others draw, and are dropped).
    held: dict[int, list[Held]] = {}
    is_custom_code = root.is_custom_code() if callable(getattr(root, "is_custom_code", None)) else False
    initializers = {id(owner): _initializer(owner, is_custom_code) for _, owner in order}
    for module, _ in order:  # transformers 4.x ran post_init's pass on the meta tensors: it did nothing
        if getattr(module, "_is_hf_initialized", False):
            module._is_hf_initialized = False
    with torch.no_grad(), _guard():
        for index, (module, owner) in enumerate(order):
            installed = []
            for kind, slots, name, tensor in _state(module):
                full = torch.empty(tensor.shape, dtype=tensor.dtype, device=init.device)
                if full.is_floating_point():
                    full.fill_(float("nan"))
                if kind == "parameter":
                    full = torch.nn.Parameter(full, requires_grad=tensor.requires_grad)
                held.setdefault(id(tensor), []).append((module, kind, slots, name, tensor, full))
                slots[name] = full
                installed.append(full)
            initializers[id(owner)](module)
            reset = getattr(module, "reset_parameters", None)
            if installed and callable(reset) and all(torch.isnan(t).all() for t in installed if t.is_floating_point()):
                reset()  # _init_weights left this module alone (4.x's default): its constructor's init
            for key in [key for key, at in last.items() if at == index and key in held]:
                _finish(init, held.pop(key), creator.get(key), registered.get(key))
    init.partitions.comm.discard_current()


def _finish(init: Init, held: list[Held], creator: tuple[torch.nn.Module, str] | None,
            as_registered: torch.Tensor | None) -> None:
    """Check, broadcast rank 0's values, and put the final tensor back where the meta one was."""
    source = next((h for h in held if creator is not None and h[0] is creator[0] and h[3] == creator[1]), held[0])
    module, kind, _, name, original, full = source
    if full.is_floating_point() and torch.isnan(full).any() and as_registered is not None:
        full.data.copy_(as_registered)  # left by _init_weights as its constructor made it
    if full.is_floating_point() and torch.isnan(full).any():
        raise RayZeroValueError(
            f"rayzero.zero.Init: {type(module).__name__}.{name} (a {kind}) was not set by the model's "
            "_init_weights, and the value its constructor gave it was drawn on the meta device "
            "([Note: Hugging Face models under zero.Init]). Initialise it in _init_weights, or pass "
            "param_init_fn=<callable(module)> to rayzero.zero.Init")
    value = full.data
    init.partitions.comm.broadcast(value, src=0)
    if kind == "buffer":
        for _, _, slots, slot, _, _ in held:
            slots[slot] = value
        return
    for _, _, slots, slot, _, _ in held:
        slots[slot] = original  # the same Parameter object the model (and its ties) hold
    init._adopt(original, f"{type(module).__name__}.{name}", value)
