"""`engine.compile(...)`: torch.compile under every ZeRO stage (DeepSpeed 0.19.8's signature).

[Note: compiling stage 3]
Stages 0-2 keep every parameter whole on every rank and reduce gradients from per-parameter
post-accumulate-grad hooks, which autograd runs outside any compiled graph: the whole model is
compiled in place (`module.compile(...)`), as DeepSpeed does.

Stage 3 gathers parameters in module forward pre-hooks (all-gathers into a buffer whose storage is
resized back from 0 bytes, then `param.data` pointed at it) and releases them in forward hooks
(stage3/hooks.py, [Note: stage-3 parameter storage]). A compiled region cannot contain that: dynamo
traces the collectives and the `param.data` swaps, breaks its graph at the data-pointer comparisons
and the multi-grad hook, and guards on the hook's module index and on each parameter's shape,
released (0 elements) or gathered. Measured on torch 2.13, `block.compile()` of both blocks of a
small GPT over the unchanged hooks, four steps: 20 graphs, 24 graph breaks, the recompile limit hit
(losses still right: dynamo fell back to eager). So, as FSDP2 users `fully_shard` each block and
compile each block:
  - the unit compiled is a *region*: by default each child of the model's largest `nn.ModuleList`
    of same-class modules (a transformer's blocks), or the modules the caller names (`regions=`);
  - each region fetches as one (`Stage3Coordinator.fuse`): its forward pre-hook gathers the
    parameters of every module under it, its forward hook releases them, and the modules under it
    have no hooks left; the prefetch trace records one event per region (a trace recorded before
    is dropped at the first mismatch and recorded afresh: compiling after some steps works);
  - only the region's `forward` is compiled (the `forward` attribute replaced), so its hooks run
    eagerly around the compiled code: inside it every parameter is gathered and full-shaped, and no
    hook runs. Measured: one graph for all the blocks, no graph break, no recompile.
  - everything outside the regions (embeddings, the head, the loss) runs eagerly.
Gathered parameters are views of buffers whose storage is freed and allocated again between uses:
their data pointers change from call to call (dynamo does not guard on them; CUDA graphs,
`mode="reduce-overhead"`, would have to re-record: not recommended at stage 3). The backward graph
AOT autograd compiles saves the parameters (or views of them) like eager autograd does, and the
region's pre-backward hook gathers into the same storage before that graph runs.
The hooks themselves are wrapped in `torch.compiler.disable`, so a region compiled some other way
(a whole-model `torch.compile`, Accelerate's regional `module.compile()`, Lightning's compiled step)
runs them eagerly too, at the cost of a graph break at each module that gathers (the same two
blocks compiled in place without fusing: 9 graphs, a break at every hook, no recompile). A module
compiled in place before the first forward is fused then (`adopt_compiled_modules`): its compiled
`_call_impl` meets its own hooks at its edges only.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

from rayzero.config.errors import RayZeroValueError

logger = logging.getLogger(__name__)

Compiler = Callable[[Callable[..., Any]], Callable[..., Any]]
"""Turns a function into its compiled form: `torch.compile(fn, backend=..., **kwargs)`, or a
dynamo context a caller already holds (Lightning's `_compiler_ctx["dynamo_ctx"]`)."""

RegionSpec = Iterable[str | torch.nn.Module | type]
"""Modules to compile one by one: qualified names (`"transformer.h.0"`), modules, or classes
(every instance, as `_no_split_modules` names an HF model's block class)."""


@dataclass
class CompiledModel:
    """What `engine.compile` did, to answer `is_compiled` and to undo it at `engine.close()`."""

    backend: Any
    compile_kwargs: dict[str, Any]
    regions: list[torch.nn.Module] = field(default_factory=list)
    """Modules whose `forward` was replaced by its compiled form (stage 3)."""
    in_place: list[torch.nn.Module] = field(default_factory=list)
    """Modules compiled with `module.compile(...)` (stages 0-2: the whole model)."""

    def undo(self) -> None:
        """Hand the modules back uncompiled (the engine's close())."""
        for module in self.regions:
            module.__dict__.pop("forward", None)
        for module in self.in_place:
            module._compiled_call_impl = None
        self.regions, self.in_place = [], []


def compile_engine(engine: Any, backend: Any, compile_kwargs: dict[str, Any] | None, schedule: Any,
                   compiled_autograd_enabled: bool, regions: RegionSpec | None) -> CompiledModel:
    """The body of `ZeroEngine.compile` ([Note: compiling stage 3])."""
    if schedule is not None:
        raise RayZeroValueError(
            f"engine.compile(schedule={schedule!r}): schedules are DeepSpeed's DeepCompile passes, which "
            "rayzero does not implement; drop schedule= (torch.compile itself runs without one)")
    if compiled_autograd_enabled:
        raise RayZeroValueError(
            "engine.compile(compiled_autograd_enabled=True) is not supported: compiled autograd would trace "
            "rayzero's gradient hooks, which reduce gradients with collectives as they appear; drop the flag "
            "(the forward and its backward are still compiled)")
    kwargs = dict(compile_kwargs or {})
    if "backend" in kwargs:
        logger.warning("The `backend` in `compile_kwargs` is overridden by the `backend` argument (%r), as "
                       "DeepSpeed does", backend)
        kwargs.pop("backend")
    compiled = CompiledModel(backend, dict(kwargs))

    def compiler(function: Callable[..., Any]) -> Callable[..., Any]:
        return torch.compile(function, backend=backend, **kwargs)

    coordinator = _coordinator(engine)
    chosen = find_regions(engine.module, regions)
    if coordinator is None and regions is None:
        engine.module.compile(backend=backend, **kwargs)
        compiled.in_place.append(engine.module)
    elif coordinator is None:
        for module in chosen:
            module.compile(backend=backend, **kwargs)
        compiled.in_place.extend(chosen)
    elif chosen:
        compile_regions(coordinator, chosen, compiler, compiled)
    else:
        logger.warning("engine.compile at ZeRO stage 3 found no repeated blocks (an nn.ModuleList of modules "
                       "of one class) to compile one by one: the whole model is compiled, with a graph break "
                       "at every module that gathers parameters; name the blocks with regions= to compile "
                       "them whole")
        engine.module.compile(backend=backend, **kwargs)
        compiled.in_place.append(engine.module)
    return compiled


def compile_with(engine: Any, compiler: Compiler, regions: RegionSpec | None = None) -> CompiledModel | None:
    """Stage 3 only: compile the engine's regions with `compiler`, a dynamo context a caller already
    holds (a LightningModule's); None (nothing done) at stages 0-2 or when there is no region."""
    coordinator = _coordinator(engine)
    chosen = find_regions(engine.module, regions)
    if coordinator is None or not chosen:
        return None
    compiled = CompiledModel(backend=compiler, compile_kwargs={})
    compile_regions(coordinator, chosen, compiler, compiled)
    return compiled


def compile_regions(coordinator: Any, modules: list[torch.nn.Module], compiler: Compiler,
                    compiled: CompiledModel) -> None:
    """Fuse each region's fetches and compile its `forward` ([Note: compiling stage 3])."""
    for module in modules:
        coordinator.fuse(module)
        module.forward = compiler(module.forward)
        compiled.regions.append(module)


def adopt_compiled_modules(engine: Any) -> None:
    """Modules compiled in place by someone else (Accelerate's regional compilation calls
    `block.compile()` on the engine's model) fetch as one from now on ([Note: compiling stage 3]):
    their compiled `_call_impl` then meets the region's hooks at its edges only."""
    coordinator = _coordinator(engine)
    if coordinator is None:
        return
    for module in engine.module.modules():
        if getattr(module, "_compiled_call_impl", None) is not None and module is not engine.module:
            coordinator.fuse(module)


def find_regions(model: torch.nn.Module, regions: RegionSpec | None) -> list[torch.nn.Module]:
    """The modules to compile one by one: those `regions` names, else the children of the largest
    (in modules) `nn.ModuleList` whose children are all of one class; [] when there is none."""
    if regions is None:
        return _repeated_blocks(model)
    named = dict(model.named_modules())
    chosen: list[torch.nn.Module] = []
    for spec in regions:
        if isinstance(spec, str):
            if spec not in named:
                raise RayZeroValueError(f"engine.compile(regions=[{spec!r}, ...]): the model has no module "
                                        f"named {spec!r}; name modules as model.named_modules() does")
            found = [named[spec]]
        elif isinstance(spec, type):
            found = [module for module in model.modules() if isinstance(module, spec)]
            if not found:
                raise RayZeroValueError(f"engine.compile(regions=[{spec.__name__}, ...]): the model has no "
                                        f"{spec.__name__} module")
        elif isinstance(spec, torch.nn.Module):
            if all(module is not spec for module in model.modules()):
                name = type(spec).__name__
                raise RayZeroValueError(f"engine.compile(regions=[...]): a {name} given is not part of the "
                                        "model this engine trains")
            found = [spec]
        else:
            raise RayZeroValueError(f"engine.compile(regions=[{spec!r}, ...]): give module names, modules or "
                                    "module classes")
        chosen.extend(module for module in found if all(module is not seen for seen in chosen))
    return chosen


def _repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    best: list[torch.nn.Module] = []
    best_size = 0
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        blocks = list(module)
        if any(type(block) is not type(blocks[0]) for block in blocks):
            continue
        # Modules, not elements: at stage 3 a released parameter has 0 elements.
        size = sum(1 for block in blocks for _ in block.modules())
        if size > best_size:
            best, best_size = blocks, size
    return best


def _coordinator(engine: Any) -> Any:
    """The stage-3 hooks, when the engine's strategy gathers parameters in module hooks."""
    return getattr(engine.strategy, "coordinator", None)
