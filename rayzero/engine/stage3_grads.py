"""Stage 3 gradient reduction: full gradients are reduce-scattered in buckets during backward.

As soon as a parameter's gradient is complete (its post-accumulate-grad hook, which fires once per
backward even for a tied weight used twice), the full gradient joins a bucket and the parameter's
`.grad` is dropped. A bucket of at most `reduce_bucket_size` elements becomes one
`reduce_scatter` whose input is laid out rank-major — rank r's slice is the concatenation of the
r-th shard of every gradient in the bucket — so the output is exactly this rank's gradient shards,
which are added (in fp32) into the fp32 master gradient views. With `overlap_comm` the collective
runs asynchronously and is only waited for when the next bucket is sent or at the end of backward,
so at most two buckets are alive.
"""
from __future__ import annotations

import torch

from rayzero.engine.comm import Communicator
from rayzero.engine.stage3_params import PartitionedParam


class GradientReducer:
    """Buckets full gradients, reduce-scatters them, accumulates shards into master gradients."""

    def __init__(self, comm: Communicator, bucket_size: int, reduce_dtype: torch.dtype,
                 overlap: bool, master_grads: dict[int, torch.Tensor]) -> None:
        self.comm = comm
        self.bucket_size = max(1, int(bucket_size))
        self.reduce_dtype = reduce_dtype
        self.overlap = overlap
        # id(entry) -> fp32 view of that parameter's master-gradient shard (padded length).
        self.master_grads = master_grads
        self._bucket: list[tuple[PartitionedParam, torch.Tensor]] = []
        self._bucket_numel = 0
        self._in_flight: tuple[object, torch.Tensor, list[PartitionedParam], torch.Tensor] | None = None
        # Entries that received a gradient since the last `clear_seen` (unused-parameter check).
        self.seen: set[int] = set()
        self.bucket_bytes_peak = 0

    def add(self, entry: PartitionedParam, grad: torch.Tensor) -> None:
        self._bucket.append((entry, grad))
        self.seen.add(id(entry))
        self._bucket_numel += entry.full.numel()
        if self._bucket_numel >= self.bucket_size:
            self.flush()

    def flush(self) -> None:
        """Send the current bucket (if any)."""
        if not self._bucket:
            return
        world = self.comm.world_size
        shard_total = sum(entry.shard_numel for entry, _ in self._bucket)
        send = torch.empty(world * shard_total, dtype=self.reduce_dtype, device=self._bucket[0][1].device)
        rows = send.view(world, shard_total)
        offset = 0
        for entry, grad in self._bucket:
            width = entry.shard_numel
            flat = grad.reshape(-1)
            if flat.numel() == world * width:
                rows[:, offset:offset + width].copy_(flat.view(world, width))
            else:  # the last rank's shard ends in padding: copy the real elements, zero the rest
                padded = torch.zeros(world * width, dtype=self.reduce_dtype, device=send.device)
                padded[: flat.numel()].copy_(flat)
                rows[:, offset:offset + width].copy_(padded.view(world, width))
            offset += width
        entries = [entry for entry, _ in self._bucket]
        self._bucket, self._bucket_numel = [], 0
        self.bucket_bytes_peak = max(self.bucket_bytes_peak, send.numel() * send.element_size())
        received = torch.empty(shard_total, dtype=self.reduce_dtype, device=send.device)
        self.wait()  # at most one bucket in flight besides the one being filled
        work = self.comm.reduce_scatter(received, send, async_op=True)
        self._in_flight = (work, received, entries, send)  # `send` must outlive the collective
        if not self.overlap:
            self.wait()

    def wait(self) -> None:
        """Complete the in-flight bucket: add this rank's summed shards into the fp32 master
        gradients (the engine divided the loss by the world size: [Note: gradient averaging])."""
        if self._in_flight is None:
            return
        work, received, entries, _send = self._in_flight
        self._in_flight = None
        work.wait()
        shards = received.to(torch.float32)
        offset = 0
        for entry in entries:
            width = entry.shard_numel
            target = self.master_grads[id(entry)]
            # master gradients may live off the compute device (offload backend): move, then add
            target.add_(shards[offset:offset + width].to(target.device, non_blocking=True))
            offset += width

    def finish(self) -> None:
        self.flush()
        self.wait()
