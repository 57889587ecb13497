"""A LightningModule the user compiled (`trainer.fit(torch.compile(model))`) under RayZeroStrategy.

[Note: a compiled LightningModule]
Lightning unwraps the `OptimizedModule` the user passed and compiles the LightningModule's own
`forward` and `*_step` methods with the user's dynamo context (`lightning.pytorch.utilities.compile.
from_compiled`); it allows that for DDPStrategy and its subclasses, RayZeroStrategy among them. At
ZeRO stages 0-2 that compiled step is what runs, as under DDP: the engine's hooks are gradient
hooks that autograd runs outside the graph. At stage 3 the modules' gather/release hooks would
split it at every module that holds parameters ([Note: compiling stage 3] in
rayzero/engine/compile.py), so the strategy undoes Lightning's compile and compiles the model's
blocks instead, one by one, with the same dynamo context (the user's backend and options); a model
without repeated blocks keeps Lightning's compile.
"""
from __future__ import annotations

from typing import Any

from rayzero.engine.compile import compile_with


def compile_lightning_module(engine: Any, module: Any) -> None:
    """At stage 3, a compiled LightningModule's blocks compiled by the engine instead
    ([Note: a compiled LightningModule]); nothing otherwise."""
    context = getattr(module, "_compiler_ctx", None)
    if context is None or engine.compiled is not None:
        return
    from lightning.pytorch.utilities.compile import to_uncompiled

    compiled = compile_with(engine, context["dynamo_ctx"])
    if compiled is not None:
        to_uncompiled(module)
        engine.compiled = compiled
