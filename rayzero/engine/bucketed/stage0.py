"""ZeRO stage 0: plain data parallelism with bucketed all-reduce overlapped with backward.

Every rank keeps full parameters, full gradients, full fp32 masters and full optimizer state;
one asynchronous all-reduce per bucket at the accumulation boundary, launched from the
gradient hooks while backward goes on (2Ψ per step, [Note: communication
accounting]). Gradients accumulate locally between boundaries, like DDP's no_sync.
"""
from __future__ import annotations

import torch

from rayzero.engine.bucketed.strategy import Bucket, BucketedStrategy, Finish
from rayzero.engine.offload.backend import StateKind


class Stage0Strategy(BucketedStrategy):
    stage = 0
    partitions_optimizer_state = False
    gradients_partitioned = False  # every rank holds the same full gradients: no norm all-reduce
    always_overlaps = True
    reduces_per_parameter_dtype = False

    FIRST_BUCKET_BYTES = 1 << 20
    """DDP's first bucket (`torch.distributed._DEFAULT_FIRST_BUCKET_BYTES`): the gradients backward
    produces first go on the wire while it computes the rest, instead of waiting for a whole
    `reduce_bucket_size` bucket (DeepSpeed's default 5e8 elements is one bucket for most models)."""

    def _first_bucket_elements(self, ordered: list, group_index: int) -> int | None:
        if group_index != 0 or not ordered:  # later groups' first gradients come late anyway
            return None
        return max(1, self.FIRST_BUCKET_BYTES // ordered[0].element_size())

    def _init_gradient_storage(self, bucket: Bucket) -> None:
        self._attach_full_gradient_buffer(bucket)
        numel = bucket.layout.numel
        if self.aliased and bucket.reduce_dtype == torch.float32:
            bucket.master_grad = bucket.grad_buffer[:numel]
        else:
            bucket.master_grad = self.offload.allocate(StateKind.MASTER_GRAD, numel, torch.float32)

    def _reduce_bucket(self, bucket: Bucket, async_op: bool) -> tuple[object, Finish]:
        numel = bucket.layout.numel
        grads = bucket.grad_buffer[:numel]
        in_place = grads.dtype == bucket.reduce_dtype
        wire = grads if in_place else grads.to(bucket.reduce_dtype)
        work = self.comm.all_reduce(wire, async_op=async_op)

        def finish() -> None:
            if bucket.master_grad.data_ptr() != grads.data_ptr():  # else reduced in place already
                bucket.master_grad.copy_(wire)
        return work, finish

    def _publish(self) -> None:
        if self.aliased:
            return  # the optimizer updated the parameters themselves
        for bucket in self.buckets:
            bucket.param_buffer[:bucket.layout.numel].copy_(bucket.master)
