"""Build DeepSpeed's CPU kernels that the tests use as oracles, once, before the tests run.

DeepSpeed compiles its ops on first use (a JIT build with ninja into torch's extension cache,
`~/.cache/torch_extensions`, or `TORCH_EXTENSIONS_DIR`). On a fresh machine the first test to build
`DeepSpeedCPUAdam` or `FusedAdam` (tests/dist/test_fidelity_bias_correction.py, the offload parity
tests) spent about two minutes of its time compiling on the 2-core CI machine, with the other xdist
worker's tests running beside it. `make test` runs this first instead: what DeepSpeed's own docs call
pre-building the ops, done here with the op builders' `load()` (the same cache the tests then hit),
because `pip install` with `DS_BUILD_OPS=1` would also try the ops that cannot build here (libaio).
A cached op loads in well under a second. Without deepspeed installed this does nothing.
"""
from __future__ import annotations

import sys
import time

OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")
"""The ops DeepSpeed loads on a CPU machine in our tests: its CPU Adam (offload), FusedAdam (the
device-side Adam, built for the CPU) and the shared-memory collectives of its CPU accelerator."""


def main() -> int:
    try:
        from deepspeed.ops.op_builder import cpu as builders
    except ImportError:
        print("build_deepspeed_ops: deepspeed is not installed; nothing to build")
        return 0
    for name in OPS:
        started = time.monotonic()
        builder = getattr(builders, name)()
        if not builder.is_compatible(verbose=False):
            print(f"build_deepspeed_ops: {builder.NAME} cannot build here; the tests that need it say so")
            continue
        try:
            builder.load(verbose=False)
        except Exception as error:  # noqa: BLE001 - the test that needs the op fails with the build's own error
            print(f"build_deepspeed_ops: {builder.NAME} did not build ({type(error).__name__}: {error}); "
                  "the tests that use it will build it again and report why")
            continue
        print(f"build_deepspeed_ops: {builder.NAME} ready in {time.monotonic() - started:.1f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
