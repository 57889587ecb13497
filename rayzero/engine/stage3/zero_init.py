"""`rayzero.zero.Init`: build a model already partitioned for stage 3, never holding it whole.

[Note: partitioned construction]
Inside the context, every parameter is put on the meta device as it is registered: torch's global
parameter *registration* hook (`register_module_parameter_registration_hook`, a public API, removed
on exit; nothing is patched) returns a meta stand-in, so the constructor's own initialisation of
it (`reset_parameters()`, `normal_`) touches shapes only, allocates nothing and draws no random
numbers. Buffers and every other tensor are built as usual, so what a constructor computes into a
buffer (a causal mask, a rotary table) keeps its value, as under DeepSpeed's Init. The same
hooks record which module created each parameter and the order in which modules finished
construction. On exit the modules are materialised one at a
time, in that order: the module's own parameters get real (temporary) storage, its
`reset_parameters()` runs, rank 0's values are broadcast, each rank keeps only its shard and the
full tensors are dropped; buffers move to the device, with rank 0's values. Peak memory is
therefore about one module's parameters (plus the buffers).

Same seed => same model as building it normally: standard modules draw their initial values in
`reset_parameters()` at the end of their `__init__`, i.e. in construction-completion order, which
is the order replayed here. A weight tied after construction (`head.weight = embed.weight`) is
materialised under its creator, and the module it was tied into still runs its own init on a
temporary, so the random stream advances exactly as in a normal build. Limits: a module with
parameters but no `reset_parameters()` must be given `param_init_fn`; initial values
come from the random generator of the device the model is materialised on. A Hugging Face model is
initialised by its own `_init_weights` instead ([Note: Hugging Face models under zero.Init]).
"""
from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.modules import module as torch_module

from rayzero.config.errors import RayZeroValueError
from rayzero.engine.comm import Communicator
from rayzero.engine.distributed import compute_device, init_distributed
from rayzero.engine.stage3.parameters import ParamPartitions, lookup
from rayzero.engine.stage3.zero_init_hf import is_pretrained, materialize_hf

logger = logging.getLogger(__name__)


def _zero_stage(config: Any) -> int | None:
    if config is None:
        return None
    if isinstance(config, (str, Path)):
        text = str(config).strip()
        config = json.loads(text) if text.startswith("{") else json.loads(Path(text).read_text())
    if isinstance(config, dict):
        return int((config.get("zero_optimization") or {}).get("stage", 0))
    return int(getattr(getattr(config, "zero_optimization", None), "stage", 0))


class Init:
    """Context manager: modules built inside are partitioned across the data-parallel ranks.

    DeepSpeed's keyword names are accepted (`config_dict_or_path`/`config`, `data_parallel_group`,
    `enabled`, `module`); `remote_device`, `pin_memory` and `dtype` are DeepSpeed memory placements
    this engine decides elsewhere (offload config, precision config) and are ignored with a warning.
    `param_init_fn(module)` initialises a module's own parameters/buffers when it has no
    `reset_parameters()`. `Init(module=model)` partitions an already built model immediately.
    """

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True,
                 remote_device: Any = None, pin_memory: bool = False, dtype: torch.dtype | None = None,
                 param_init_fn: Callable[[torch.nn.Module], None] | None = None,
                 device: torch.device | None = None) -> None:
        stage = _zero_stage(config if config is not None else config_dict_or_path)
        if stage is not None and stage != 3:
            logger.warning("rayzero.zero.Init: zero_optimization.stage is %s, not 3; building the model "
                           "unpartitioned", stage)
            enabled = False
        for name, value, default in (("remote_device", remote_device, None), ("pin_memory", pin_memory, False),
                                     ("dtype", dtype, None)):
            if value != default:
                logger.warning("rayzero.zero.Init(%s=%r) is ignored: placement and precision come from the "
                               "config's offload_param and fp16/bf16 sections", name, value)
        self.enabled = enabled
        self.param_init_fn = param_init_fn
        self.device = torch.device(device) if device is not None else compute_device()
        if enabled and dist.is_available() and not dist.is_initialized() and "WORLD_SIZE" in os.environ:
            # As DeepSpeed's Init and rayzero.initialize do: under torchrun the shards must span the
            # launched ranks, not this process alone (which initialize would then refuse).
            init_distributed()
        initialized = dist.is_available() and dist.is_initialized()
        self.partitions = ParamPartitions(Communicator(data_parallel_group if initialized else None), self.device)
        self._handles: list[Any] = []
        self._creator: dict[int, tuple[torch.nn.Module, str]] = {}
        self._params: list[torch.nn.Parameter] = []  # keeps recorded ids valid until exit
        self._registered: dict[int, torch.Tensor] = {}  # id(stand-in) -> a vector's value as registered
        self._seen: list[torch.nn.Module] = []
        self._completed: list[torch.nn.Module] = []
        if module is not None and enabled:
            self._partition_built(module)

    # ---- recording --------------------------------------------------------------------------
    def __enter__(self) -> Init:
        if not self.enabled:
            return self
        self._handles = [
            torch_module.register_module_parameter_registration_hook(self._on_parameter),
            torch_module.register_module_buffer_registration_hook(self._on_buffer),
            torch_module.register_module_module_registration_hook(self._on_child),
        ]
        return self

    def _note(self, module: torch.nn.Module) -> None:
        if all(existing is not module for existing in self._seen):
            self._seen.append(module)

    def _on_parameter(self, module: torch.nn.Module, name: str,
                      param: torch.nn.Parameter | None) -> torch.nn.Parameter | None:
        self._note(module)
        if param is None or id(param) in self._creator:
            return None  # a tie of a parameter already registered (already a stand-in)
        previous = module._parameters.get(name)
        if not param.is_meta and previous is not None and id(previous) in self._creator:
            raise RayZeroValueError(
                f"rayzero.zero.Init: {type(module).__name__}.{name} was assigned values over the parameter "
                "built inside the block (loading weights, such as transformers' from_pretrained, inside "
                "rayzero.zero.Init). Those values would be lost: load the model outside the block "
                "(`model = AutoModelForCausalLM.from_pretrained(...)`); rayzero.initialize partitions it for "
                "stage 3. rayzero.zero.Init is for models built from a config (`from_config`, `Model(config)`)")
        stand_in = param
        if not param.is_meta and param.dim() <= 1:
            # [Note: Hugging Face models under zero.Init]: a vector's value as constructed (a norm's
            # ones), for a model whose _init_weights leaves it as its constructor made it
            self._registered[id(param)] = param.detach().clone()
        if not param.is_meta:
            # [Note: partitioned construction]: registered in the parameter's place
            stand_in = type(param)(torch.empty_like(param, device="meta"), requires_grad=param.requires_grad)
        if id(param) in self._registered:
            self._registered[id(stand_in)] = self._registered.pop(id(param))
        self._creator[id(stand_in)] = (module, name)
        self._params.append(stand_in)
        return stand_in

    def _on_buffer(self, module: torch.nn.Module, name: str, buffer: torch.Tensor | None) -> None:
        self._note(module)

    def _on_child(self, parent: torch.nn.Module, name: str, child: torch.nn.Module | None) -> None:
        # A module is registered into its parent right after its own __init__ (and so its
        # reset_parameters) finished: this is the construction-completion order.
        self._note(parent)  # a parent without parameters of its own may be the root
        if child is not None and all(done is not child for done in self._completed):
            self._completed.append(child)

    def __exit__(self, *exc_info: object) -> None:
        if not self.enabled:
            return
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if exc_info[0] is None:
            self._materialize()
        self._creator.clear()
        self._params.clear()
        self._registered.clear()

    # ---- materialising ----------------------------------------------------------------------
    def _materialize(self) -> None:
        completed_ids = {id(m) for m in self._completed}
        roots = [m for m in self._seen if id(m) not in completed_ids]
        hf_roots = [] if self.param_init_fn is not None else [root for root in roots if is_pretrained(root)]
        hf_modules = {id(m) for root in hf_roots for m in root.modules()}
        roots = [root for root in roots if id(root) not in hf_modules]
        order = [m for m in self._completed if id(m) not in hf_modules] + roots
        order_ids = {id(m) for m in order}
        for module in self._seen:  # modules with state that were never attached anywhere
            if id(module) not in order_ids and id(module) not in hf_modules:
                order.append(module)
        live = {id(p) for root in roots for p in root.parameters()}
        created: dict[int, list[tuple[str, torch.nn.Parameter]]] = {}
        for param in self._params:
            module, name = self._creator[id(param)]
            created.setdefault(id(module), []).append((name, param))
        with torch.no_grad():
            for module in order:
                self._materialize_module(module, created.get(id(module), []), live)
        for root in hf_roots:
            materialize_hf(self, root, self._creator, self._registered)
        for module in self._seen:
            for name, buffer in module._buffers.items():
                if buffer is not None and not buffer.is_meta:
                    module._buffers[name] = buffer.to(self.device)
                    self.partitions.comm.broadcast(module._buffers[name], src=0)
        self.partitions.comm.discard_current()

    def _materialize_module(self, module: torch.nn.Module, created: list[tuple[str, torch.nn.Parameter]],
                            live: set[int]) -> None:
        meta_buffers = [name for name, buf in module._buffers.items() if buf is not None and buf.is_meta]
        created = [(name, param) for name, param in created if param.is_meta]
        if not created and not meta_buffers:
            return
        init = self.param_init_fn or getattr(module, "reset_parameters", None)
        if init is None:
            raise RayZeroValueError(
                f"rayzero.zero.Init cannot initialise {type(module).__name__}: it has parameters but no "
                "reset_parameters() method. Define reset_parameters() (initialising only this module's own "
                "parameters) or pass param_init_fn=<callable(module)> to Init")
        # The module's attributes as they were when its own __init__ ran its init: temporaries
        # with real storage under the names it created (ties made later are restored afterwards).
        current = {name: module._parameters.get(name) for name, _ in created}
        for name, param in created:
            module._parameters[name] = torch.nn.Parameter(
                torch.empty(param.shape, dtype=param.dtype, device=self.device), requires_grad=param.requires_grad)
        for name in meta_buffers:
            buf = module._buffers[name]
            module._buffers[name] = torch.empty(buf.shape, dtype=buf.dtype, device=self.device)
        if self.param_init_fn is not None:
            self.param_init_fn(module)
        else:
            init()
        for name in meta_buffers:
            self.partitions.comm.broadcast(module._buffers[name], src=0)
        for name, param in created:
            value = module._parameters[name].data
            module._parameters[name] = current[name]
            if id(param) not in live:
                continue  # replaced by a tie after construction: its values were never used
            self.partitions.comm.broadcast(value, src=0)
            self._adopt(param, f"{type(module).__name__}.{name}", value)
        self.partitions.comm.discard_current()

    def _adopt(self, param: torch.nn.Parameter, name: str, value: torch.Tensor) -> None:
        """Keep this rank's fp32 piece of `value` as `param`'s partition; drop the full tensor."""
        if param.is_meta:
            # A meta tensor cannot take CPU/CUDA data through `.data`; swap_tensors moves the same
            # Python object (held by tied modules) off the meta device.
            torch.utils.swap_tensors(param, torch.nn.Parameter(
                torch.empty(0, dtype=value.dtype, device=self.device), requires_grad=param.requires_grad))
        piece = self.partitions.local_piece(value.reshape(-1))
        self.partitions.add(param, name, piece, value.shape, persistent=False)

    def _partition_built(self, module: torch.nn.Module) -> None:
        """`Init(module=model)`: partition an already constructed model in place."""
        with torch.no_grad():
            for name, param in module.named_parameters():
                if lookup(param) is not None:
                    continue
                value = param.detach().to(self.device)
                self.partitions.comm.broadcast(value, src=0)
                self._adopt(param, name, value)
            for buf in module.buffers():
                buf.data = buf.data.to(self.device)
        self.partitions.comm.discard_current()
