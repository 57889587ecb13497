"""ZeRO stage 2: stage 1 plus gradients partitioned — reduce-scattered bucket by bucket during
backward, every micro-step, into the fp32 gradient slice this rank owns.

No full-size gradient buffer survives a backward: a bucket's gradients are copied into a staging
buffer (`contiguous_gradients`: two preallocated buffers of the largest bucket reused in turn;
otherwise a fresh one per bucket), the parameters' `.grad` are freed, and the reduce-scatter runs
(asynchronously with `overlap_comm`). `reduce_scatter: false` all-reduces the staging buffer
instead and keeps the own slice (2Ψ instead of Ψ on the wire, DeepSpeed's behaviour).
Traffic per optimizer step: gas·Ψ reduce-scatter + Ψ all-gather (2Ψ at gas 1).
"""
from __future__ import annotations

import torch

from rayzero.engine.bucketed.stage1 import publish_partitioned
from rayzero.engine.bucketed.strategy import Bucket, BucketedStrategy, Finish
from rayzero.engine.offload.backend import StateKind


class Stage2Strategy(BucketedStrategy):
    stage = 2
    partitions_optimizer_state = True
    reduces_every_micro_step = True
    keeps_full_gradients = False

    _STAGING_RING = 2
    """Buffers reused in turn: one fills while the previous one is on the wire."""

    def _init_gradient_storage(self, bucket: Bucket) -> None:
        start, end = bucket.master_range
        bucket.master_grad = self.offload.allocate(StateKind.MASTER_GRAD, end - start, torch.float32)
        if not hasattr(self, "_staging"):
            self._staging: list[torch.Tensor] = []
            self._staging_turn = 0

    def _staging_buffer(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if not self.policy.contiguous_gradients:
            return torch.zeros(numel, dtype=dtype, device=self.device)
        if not self._staging:
            widest = max(bucket.reduce_dtype.itemsize for bucket in self.buckets)
            self._staging = [torch.empty(self._ring_numel() * widest, dtype=torch.uint8, device=self.device)
                             for _ in range(self._STAGING_RING)]
        # Reusing a buffer requires the collective that last read it to be done.
        while len(self._inflight) >= self._STAGING_RING:
            work, finish = self._inflight.pop(0)
            if work is not None:
                work.wait()
            self._timed_finish(finish)
        if numel * dtype.itemsize > self._staging[0].numel():  # a parameter past the bucket size, alone
            return torch.zeros(numel, dtype=dtype, device=self.device)
        # Raw bytes viewed as the bucket's reduce dtype: buckets of two dtypes (torch_autocast)
        # share the ring ([Note: torch_autocast] in autocast.py).
        buffer = self._staging[self._staging_turn][:numel * dtype.itemsize].view(dtype)
        self._staging_turn = (self._staging_turn + 1) % self._STAGING_RING
        buffer.zero_()
        return buffer

    def _ring_numel(self) -> int:
        """Elements of each staging buffer: the largest bucket that `reduce_bucket_size` shaped. A
        parameter larger than the bucket size is a bucket by itself (a model's embedding or head:
        39% of a 125M Llama's parameters in two); two ring buffers of its size stayed allocated for
        the run (1.58 B/param at 2 ranks), so it gets a buffer of its own for its reduction only."""
        sizes = [bucket.layout.padded_numel for bucket in self.buckets]
        shaped = [size for size, bucket in zip(sizes, self.buckets)
                  if len(bucket.params) > 1 or bucket.params[0].numel() <= self.policy.reduce_bucket_size]
        return max(shaped or sizes)

    def _reduce_bucket(self, bucket: Bucket, async_op: bool) -> tuple[object, Finish]:
        layout = bucket.layout
        staging = self._staging_buffer(layout.padded_numel, bucket.reduce_dtype)
        for slot, param in zip(layout.slots, bucket.params):
            if param.grad is not None:  # None: unused this backward, its slot stays zero
                staging[slot.offset:slot.end].copy_(param.grad.reshape(-1))
                param.grad = None  # the full gradient is no longer needed: that is stage 2
        start, end = bucket.master_range
        if self.policy.reduce_scatter:
            received = torch.empty(layout.shard_numel, dtype=staging.dtype, device=staging.device)
            work = self.comm.reduce_scatter(received, staging, async_op=async_op, scratch=True)  # zeroed on reuse
        else:
            work = self.comm.all_reduce(staging, async_op=async_op)
            received = staging[start:end]

        def finish() -> None:
            bucket.master_grad.add_(self._beside_master_grad(bucket, received))
        return work, finish

    @staticmethod
    def _beside_master_grad(bucket: Bucket, received: torch.Tensor) -> torch.Tensor:
        """`received` on the master gradient's device: as it is, or (offloaded from a GPU) copied
        into the bucket's pinned host buffer, which the add then reads."""
        if received.device == bucket.master_grad.device:
            return received
        host = bucket.host_received
        if host is None or host.shape != received.shape or host.dtype != received.dtype:
            host = torch.empty(received.shape, dtype=received.dtype, device=bucket.master_grad.device,
                               pin_memory=received.is_cuda)
            bucket.host_received = host
        return host.copy_(received)  # synchronous: the copy is complete when the add reads it

    def _publish(self) -> None:
        publish_partitioned(self)

    def _bucket_buffer_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in getattr(self, "_staging", []))
