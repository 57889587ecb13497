"""ZeRO stage 1: fp32 master weights and optimizer state partitioned across ranks.

Gradients are still accumulated in full on every rank; at the accumulation boundary each bucket is
reduce-scattered (Ψ) so a rank receives just the slice its optimizer updates, and after the step
each bucket's updated slices are all-gathered back into the parameters (Ψ): 2Ψ per step.
Memory per rank: params + full grads + (masters + optimizer state) / N.
"""
from __future__ import annotations

import torch

from rayzero.engine.bucketed.strategy import Bucket, BucketedStrategy, Finish
from rayzero.engine.offload.backend import StateKind


class Stage1Strategy(BucketedStrategy):
    stage = 1
    partitions_optimizer_state = True

    def _init_gradient_storage(self, bucket: Bucket) -> None:
        self._attach_full_gradient_buffer(bucket)
        start, end = bucket.master_range
        if self.aliased and bucket.reduce_dtype == torch.float32:
            # The reduced slice lands in this rank's own part of the full gradient buffer.
            bucket.master_grad = bucket.grad_buffer[start:end]
        else:
            bucket.master_grad = self.offload.allocate(StateKind.MASTER_GRAD, end - start, torch.float32)

    def _reduce_bucket(self, bucket: Bucket, async_op: bool) -> tuple[object, Finish]:
        reduce_dtype = bucket.reduce_dtype
        wire = bucket.grad_buffer if bucket.grad_buffer.dtype == reduce_dtype else \
            bucket.grad_buffer.to(reduce_dtype)
        # A separate output: gloo's reduce-scatter does not allow output inside input.
        received = torch.empty(bucket.layout.shard_numel, dtype=reduce_dtype, device=wire.device)
        work = self.comm.reduce_scatter(received, wire, async_op=async_op)

        def finish() -> None:
            bucket.master_grad.copy_(received)
        return work, finish

    def _publish(self) -> None:
        publish_partitioned(self)


def publish_partitioned(strategy: BucketedStrategy) -> None:
    """Stages 1-2: write each rank's updated slice into its parameter buffer, all-gather buckets."""
    works = []
    for bucket in strategy.buckets:
        start, end = bucket.master_range
        own = bucket.param_buffer[start:end]
        # From pinned host memory the copy is asynchronous, ordered before the all-gather on the same
        # stream. The host master is next written by the next step, which first needs that step's
        # gradients copied to the host synchronously on this stream, so after this copy has run.
        if not strategy.aliased:
            own.copy_(bucket.master, non_blocking=own.device.type == "cuda" and bucket.master.is_pinned())
        works.append(strategy.comm.all_gather(bucket.param_buffer, own, async_op=True))
    for work in works:
        if work is not None:
            work.wait()
