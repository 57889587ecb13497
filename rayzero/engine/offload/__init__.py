"""Where fp32 master weights, optimizer state and stage-3 parameter shards live, and where the
optimizer step runs: the `OffloadBackend` seam and its backends.

    backend.py            the seam: OffloadBackend, StateKind, NoOffload, build_offload_backend
    host.py               `cpu`: host memory, fused CPU step         [Note: offload placement]
    nvme.py               `nvme` optimizer state in swap files, tile by tile   [Note: NVMe tiles]
    nvme_param_store.py   stage-3 parameter shards in a swap file    [Note: NVMe parameter shards]
    overlapped_step.py    the CPU step overlapped with backward
    swap_io.py            scratch directories, aligned buffers, O_DIRECT file I/O   [Note: swap I/O layer]

Below the strategies (engine/bucketed, engine/stage3): imports neither (import-linter).
"""
