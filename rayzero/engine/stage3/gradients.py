"""Stage 3 gradient reduction: full gradients are reduce-scattered in planned buckets during backward.

As soon as a parameter's gradient is complete (its post-accumulate-grad hook, which fires once per
backward even for a tied weight used twice), the full gradient joins its bucket and the parameter's
`.grad` is dropped. Each bucket becomes one `reduce_scatter` whose input is laid out rank-major —
rank r's slice is the concatenation of the r-th shard of every gradient in the bucket — so the
output is exactly this rank's gradient shards, which are added (in fp32) into the fp32 master
gradient views. With `overlap_comm` the collective runs asynchronously and is only waited for when
the next bucket is sent or at the end of backward, so at most two buckets are alive.

[Note: stage 3 bucket plan]
Buckets are planned in a fixed order every rank shares, as stages 0-2 plan theirs: first the
parameters in reverse registration order (about the order backward produces their gradients),
then, after the first backward, once more in the order rank 0's gradients actually arrived
(broadcast, so every rank adopts the same plan; a plan that matches arrival keeps at most two
buckets of full gradients alive). Buckets are sent strictly in plan order: bucket k goes out once all its gradients arrived and
buckets 0..k-1 went out. At the end of backward the remaining buckets go out in order with zeros
for the parameters this rank did not use (DeepSpeed's semantics: an unused parameter's gradient is
zero). So a parameter used on some ranks only is averaged with the others' zeros, and one no rank
used gets a zero gradient, instead of the ranks sending different buckets and crashing or hanging.
When usage differs across ranks, a bucket goes out mid-backward on one rank and at the end on
another; the parameter all-gathers of backward would then interleave with it differently on each
rank, so reductions run on process groups of their own (same ranks: `Stage3Layout.reduce`), which
order them only among themselves. Their traffic is still counted with the engine's.

[Note: gradients copied on arrival]
A gradient is copied into its bucket's rank-major send buffer as soon as autograd hands it over (the
buffer is allocated, zeroed, at the bucket's first gradient), and autograd's tensor is dropped: a
bucket costs its buffer, not its buffer plus every gradient waiting for the last one (with
DeepSpeed's default reduce_bucket_size of 5e8, a bucket can be a whole model). A one-parameter bucket
whose gradient is already rank-major is sent as it is. In a world of one with nothing to reduce, a
gradient is added straight into the fp32 master gradient (after the rounding of the reduce dtype the
reduction would have applied), with no buffer at all.

With MiCS a bucket is reduce-scattered over the shard group and its shard then all-reduced over the
replica group ([Note: MiCS replicas sync once a step]); with qgZ the reduce-scatter is the quantized two-stage all-to-all ([Note: stage-3
layouts] in layout.py).

[Note: MiCS replicas sync once a step]
With gradient accumulation, the replicas' all-reduce runs only in the backward that ends the window
(DeepSpeed's MiCS does it once, at the boundary): earlier micro-steps add their reduce-scattered
shards into the master gradients unsynced, and each boundary bucket folds them back in (summed in
fp32, carried in the reduce dtype as every bucket is) before its one all-reduce: the replicas' bytes
per step are those of one micro-step, whatever the accumulation.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

from rayzero.engine.comm import Communicator, _Done
from rayzero.engine.quantize import Layout, group_size_for
from rayzero.engine.quantized_comm import quantized_reduce_scatter
from rayzero.engine.stage3.layout import Reductions
from rayzero.engine.stage3.parameters import PartitionedParam
from rayzero.engine.two_stage_reduce import two_stage_reduce_scatter


class _SeenThisBackward(set):
    """Entries that received a gradient in this backward. `strategy.py` clears it before every
    backward, which is also where a new round of planned buckets starts."""

    def __init__(self, on_clear) -> None:
        super().__init__()
        self._on_clear = on_clear

    def clear(self) -> None:
        super().clear()
        self._on_clear()


class GradientReducer:
    """Buckets full gradients in a fixed plan, reduce-scatters them in plan order, accumulates shards
    into master gradients ([Note: stage 3 bucket plan])."""

    def __init__(self, reductions: Reductions, bucket_size: int, reduce_dtype: torch.dtype,
                 overlap: bool, master_grads: dict[int, torch.Tensor],
                 reduce_dtypes: dict[int, torch.dtype] | None = None,
                 shapes: dict[int, torch.Size] | None = None) -> None:
        self.comm = reductions.shard
        self.world = reductions.world
        self.replicas = reductions.replicas
        self.quantized = reductions.quantized
        self.two_stage = reductions.two_stage
        self._thread: ThreadPoolExecutor | None = None  # runs two-stage reductions under `overlap`
        # id(entry) -> the parameter's shape: qgZ's block size ([Note: qgZ block size])
        self.shapes = shapes or {}
        self.bucket_size = max(1, int(bucket_size))
        self.reduce_dtype = reduce_dtype
        # id(entry) -> the dtype its gradient is reduced in, where not `reduce_dtype` (torch_autocast:
        # [Note: torch_autocast] in autocast.py); a bucket never mixes two.
        self.reduce_dtypes = reduce_dtypes or {}
        self.overlap = overlap
        # id(entry) -> fp32 view of that parameter's master-gradient shard (padded length).
        self.master_grads = master_grads
        self._keys = list(master_grads)  # registration order; positions are the same on every rank
        self._set_plan(self._keys[::-1])
        self._next = 0  # the next bucket to send, the same sequence on every rank
        self._open = False  # a backward's buckets are pending (set on the first gradient or clear)
        self._arrival: list[int] | None = []  # first backward's arrival order, then None (re-planned)
        self._in_flight: tuple[object, torch.Tensor, list[int], torch.Tensor, bool] | None = None
        # Keys whose master-gradient shard is known to be zero (allocated zeroed; `grads_zeroed`):
        # a one-parameter bucket reduce-scatters straight into it instead of into a buffer then add.
        self._zero: set[int] = set(master_grads)
        # Entries that received a gradient since the last `clear` (unused-parameter check).
        self.seen: set[int] = _SeenThisBackward(self._open_round)
        self.bucket_bytes_peak = 0
        # Called with the keys whose shards were just added ([Note: step overlapped with backward]).
        self.on_added = None
        # Waits on a bucket's Work ([Note: stalled stage-3 collectives]; set by the strategy).
        self.waiter = lambda work: work.wait()
        # Called before the first write into the master gradients of a backward ([Note: master
        # gradients between steps] in strategy.py; set by the strategy).
        self.before_write = lambda: None
        # [Note: MiCS replicas sync once a step]: this backward ends the accumulation window; earlier
        # micro-steps of the window added shards not yet summed across the replicas.
        self.boundary = True
        self._unsynced = False
        # A world of one with nothing quantized: gradients go straight into the master gradients.
        self._local = self.comm.world_size == 1 and self.replicas is None and self.quantized is None

    def _set_plan(self, ordered_keys: list[int]) -> None:
        self.plan = self._plan(ordered_keys)
        self._bucket_of = {key: index for index, keys in enumerate(self.plan) for key in keys}
        # key -> (first column, width) of its shards in its bucket's rank-major rows
        self._column: dict[int, tuple[int, int]] = {}
        self._bucket_numel: list[int] = []  # shard elements per rank of each bucket
        for keys in self.plan:
            offset = 0
            for key in keys:
                self._column[key] = (offset, self.master_grads[key].numel())
                offset += self.master_grads[key].numel()
            self._bucket_numel.append(offset)
        self._arrived: list[set[int]] = [set() for _ in self.plan]
        # [Note: gradients copied on arrival]: each bucket's send buffer while it fills
        self._filling: list[torch.Tensor | None] = [None] * len(self.plan)

    def _replan_from_arrival(self) -> None:
        """Adopt rank 0's first-backward arrival order (one broadcast of parameter positions, once)."""
        position = {key: index for index, key in enumerate(self._keys)}
        seen = [position[key] for key in self._arrival or []]
        missing = [index for index in range(len(self._keys) - 1, -1, -1) if index not in set(seen)]
        order = torch.tensor(seen + missing, dtype=torch.int64)
        if self.world.distributed:
            dist.broadcast(order, src=self.world.ranks[0], group=self.world.group)
        self._arrival = None
        self._set_plan([self._keys[index] for index in order.tolist()])

    def _plan(self, keys: list[int]) -> list[list[int]]:
        """Buckets of about `bucket_size` full elements, listed in the order they fill up.

        A parameter whose gradient alone reaches `bucket_size` is a bucket of its own, sent as it
        is (no copy: `_send`); the smaller ones around it fill the next shared bucket. Mixed into
        one bucket (a bias beside its weight), the large gradient would be copied into the
        bucket's buffer and exist twice at the peak.
        """
        world = self.comm.world_size
        plan: list[list[int]] = []
        current: dict[torch.dtype, list[int]] = {}  # the filling bucket of each reduce dtype
        numel: dict[torch.dtype, int] = {}
        for key in keys:
            full = self.master_grads[key].numel() * world
            if full >= self.bucket_size:
                plan.append([key])
                continue
            dtype = self._dtype(key)
            current.setdefault(dtype, []).append(key)
            numel[dtype] = numel.get(dtype, 0) + full
            if numel[dtype] >= self.bucket_size:
                plan.append(current.pop(dtype))
                numel[dtype] = 0
        plan.extend(current[dtype] for dtype in sorted(current, key=str))
        return plan

    def _dtype(self, key: int) -> torch.dtype:
        return self.reduce_dtypes.get(key, self.reduce_dtype)

    def _open_round(self) -> None:
        self._open = True

    def add(self, entry: PartitionedParam, grad: torch.Tensor) -> None:
        key = id(entry)
        self._open = True
        self.seen.add(key)
        if self._arrival is not None:
            self._arrival.append(key)
        if self._local:  # [Note: gradients copied on arrival]: nothing to reduce across ranks
            self.before_write()
            target = self.master_grads[key]
            flat = grad.reshape(-1).to(self._dtype(key))  # the rounding a reduction in that dtype has
            target[: flat.numel()].add_(flat.to(target.device))
            self._zero.discard(key)
            if self.on_added is not None:
                self.on_added([key])
            return
        index = self._bucket_of[key]
        self._place(index, key, grad)
        self._arrived[index].add(key)
        while self._next < len(self.plan) and len(self._arrived[self._next]) == len(self.plan[self._next]):
            self._send(self._next, grad.device)
            self._next += 1

    def _large_gradient_next(self, index: int) -> bool:
        following = index + 1
        if following >= len(self.plan) or len(self.plan[following]) != 1:
            return False
        return self.master_grads[self.plan[following][0]].numel() * self.comm.world_size >= self.bucket_size

    def _place(self, index: int, key: int, grad: torch.Tensor) -> None:
        """Copy `grad` into its columns of bucket `index`'s send buffer (allocated at the bucket's first
        gradient); a one-parameter bucket whose gradient is already rank-major keeps it as the buffer."""
        world, flat = self.comm.world_size, grad.reshape(-1)
        offset, width = self._column[key]
        total, dtype = self._bucket_numel[index], self._dtype(key)
        if len(self.plan[index]) == 1 and flat.numel() == world * total and flat.dtype == dtype \
                and grad.is_contiguous():
            self._filling[index] = flat  # sent as it is: one full gradient less at the peak
            return
        if self._filling[index] is None:
            if index == self._next and len(self._arrived[index]) + 1 == len(self.plan[index]):
                # this gradient completes the next bucket to send, whose `_issue` waits for the one in
                # flight anyway: wait before its buffer exists, not after, so the two are never alive
                # together (a tied embedding's one-parameter bucket: 0.23 B/param of GPT-2's peak,
                # bench/memory.py)
                self.wait()
            self._filling[index] = torch.zeros(world * total, dtype=dtype, device=grad.device)
            self.bucket_bytes_peak = max(self.bucket_bytes_peak, world * total * dtype.itemsize)
        rows = self._filling[index].view(world, total)
        whole = flat.numel() // width  # ranks whose shard of this gradient is full; the next ends in padding
        rows[:whole, offset:offset + width].copy_(flat[: whole * width].view(whole, width))
        rest = flat.numel() - whole * width
        if rest:
            rows[whole, offset:offset + rest].copy_(flat[whole * width:])

    def flush(self) -> None:
        """Send every remaining bucket of this backward, in plan order, zeros for unused parameters."""
        if not self._open:
            return
        if self._local:
            self._open = False
            if self._arrival is not None:
                self._replan_from_arrival()
            return
        device = next(iter(self.master_grads.values())).device if self.master_grads else torch.device("cpu")
        for filling in self._filling:
            if filling is not None:
                device = filling.device
                break
        while self._next < len(self.plan):
            self._send(self._next, device)
            self._next += 1
        self._next = 0
        self._open = False
        if self._arrival is not None:
            self.wait()  # the re-plan changes bucket membership: nothing of the old plan in flight
            self._replan_from_arrival()

    def _send(self, index: int, device: torch.device) -> None:
        keys = self.plan[index]
        send, self._filling[index] = self._filling[index], None
        self._arrived[index] = set()
        total = self._bucket_numel[index]
        if send is None:  # no parameter of this bucket was used on this rank: its rows are zero
            send = torch.zeros(self.comm.world_size * total, dtype=self._dtype(keys[0]), device=device)
        self._issue(send, total, keys, device)
        if self._large_gradient_next(index):
            # The next gradient is at least a bucket by itself (a tied embedding): autograd creates
            # it, and adds a tied weight's two uses, before any hook of ours runs, so this bucket's
            # buffers would be alive beside the backward's largest tensors (GPT-2 at 2 ranks: its
            # fp32 bucket was the 3% of the peak above FSDP2's, which reduces each block at once on
            # CPU). Finished now; only this bucket's reduction loses its overlap.
            self.wait()

    def _issue(self, send: torch.Tensor, shard_total: int, keys: list[int], device: torch.device) -> None:
        """Reduce-scatter the rank-major `send` into this rank's shards (kept in flight until `wait`)."""
        self.before_write()
        target = self.master_grads[keys[0]] if len(keys) == 1 else None
        direct = (target is not None and keys[0] in self._zero and target.dtype == send.dtype
                  and target.device == device and target.numel() == shard_total and target.is_contiguous())
        self._zero.difference_update(keys)
        self.wait()  # at most one bucket in flight besides the one being filled
        received = target if direct else torch.empty(shard_total, dtype=send.dtype, device=device)
        block = qgz_block_size([self.shapes[key] for key in keys if key in self.shapes])
        if self.quantized is not None and block:  # qgZ: [Note: quantized collectives] in quantized_comm.py
            work = quantized_reduction(received, send, *self.quantized, block)
            self._in_flight = (work, received, keys, send, direct)
            self.wait()
            return
        if self.two_stage is not None:  # gloo across nodes: [Note: two-stage reduce-scatter on gloo]
            if self.overlap and self._thread is None:
                self._thread = ThreadPoolExecutor(1, thread_name_prefix="rayzero-stage3-reduce")
            work = two_stage_reduce_scatter(received, send, *self.two_stage, self._thread if self.overlap else None)
            self._in_flight = (work, received, keys, send, direct)
            return
        # `send` is this bucket's own: a zeroed copy, or a gradient autograd handed over (p.grad is None).
        work = self.comm.reduce_scatter(received, send, async_op=True, scratch=True)
        self._in_flight = (work, received, keys, send, direct)  # `send` must outlive the collective
        if not self.overlap:
            self.wait()

    def wait(self) -> None:
        """Complete the in-flight bucket: add this rank's summed shards into the fp32 master
        gradients (the engine divided the loss by the world size: [Note: gradient averaging])."""
        if self._in_flight is None:
            return
        work, received, keys, _send, direct = self._in_flight
        self._in_flight = None
        self.waiter(work)
        if self.replicas is not None and self.boundary:  # [Note: MiCS replicas sync once a step]
            received, direct = self._with_unsynced(received, keys, direct)
            self.waiter(self.replicas.all_reduce(received, async_op=True))
        if direct:  # reduced straight into the (zero) master gradient
            if self.on_added is not None:
                self.on_added(keys)
            return
        shards = received.to(torch.float32)
        offset = 0
        for key in keys:
            target = self.master_grads[key]
            width = target.numel()
            # Master gradients may live off the compute device (offload backend): move, then add. A
            # blocking copy: a non-blocking one to the host lands in pinned memory *later*, and
            # add_ on the host would read it before it arrived.
            target.add_(shards[offset:offset + width].to(target.device))
            offset += width
        if self.on_added is not None:
            self.on_added(keys)

    def _with_unsynced(self, received: torch.Tensor, keys: list[int], direct: bool) -> tuple[torch.Tensor, bool]:
        """[Note: MiCS replicas sync once a step] At the boundary: this bucket's shards plus what
        earlier micro-steps of the window added to its master gradients (taken out of them), summed
        in fp32 and carried in the reduce dtype, ready for the one all-reduce across the replicas."""
        if not self._unsynced or direct:  # nothing accumulated, or it is already in `received`
            return received, direct
        total = received.to(torch.float32, copy=True)
        offset = 0
        for key in keys:
            target = self.master_grads[key]
            total[offset:offset + target.numel()].add_(target.to(total.device))
            target.zero_()
            offset += target.numel()
        return total.to(received.dtype), False

    def backward_done(self) -> None:
        """A backward's buckets are all added: outside the boundary, they wait for it unsynced."""
        if self.replicas is not None:
            self._unsynced = not self.boundary

    def grads_zeroed(self) -> None:
        """Every master gradient was just set to zero (the strategy's zero_grad)."""
        self._zero = set(self.master_grads)
        self._unsynced = False

    def finish(self) -> None:
        self.flush()
        self.wait()
        self.backward_done()

    def close(self) -> None:
        """The engine is done: end the reduction thread, if one was started (nothing is in flight
        after `finish`); an engine dropped without `close` leaves it to the interpreter's exit."""
        if self._thread is not None:
            self._thread.shutdown(wait=False)
            self._thread = None


GRADIENT_BITS = 4
"""qgZ's gradients travel as int4 blocks (DeepSpeed's all_to_all_quant_reduce)."""


def qgz_block_size(shapes: list[torch.Size]) -> int:
    """[Note: qgZ block size] DeepSpeed's all_to_all_quant_reduce cuts a gradient of shape (rows,
    cols) into max(rows, cols) groups, i.e. blocks of min(rows, cols) elements (the layer's width),
    and reduces a 1-D gradient unquantized. A bucket here holds several parameters: its blocks are the
    narrowest width among its matrices (between 64 and 4096 elements), and a bucket of vectors only
    (biases, norms) is reduced unquantized. The width matters: a demo GPT's int4 gradients erred by
    38% (relative norm) in blocks of 4096 and by 12% per stage in blocks of its width, 128; over
    200 steps the first ended 2.6% below flat ZeRO-3's loss, the second within 0.5% of it."""
    widths = [min(shape[-2], shape[-1]) for shape in shapes if len(shape) >= 2]
    return max(64, min(4096, min(widths))) if widths else 0


def quantized_reduction(output: torch.Tensor, input: torch.Tensor, inside: Communicator,
                        across: Communicator, block: int) -> _Done:
    """qgZ's two-stage reduce-scatter of the rank-major `input` into `output` (a sum), counted as the
    all-to-alls it runs: all local ranks' pieces for every node inside the node, then one piece per
    node across ([Note: bytes per link class] in comm.py). Synchronous, as DeepSpeed's."""
    chunk, local, nodes = output.numel(), inside.world_size, across.world_size
    layout = Layout(chunk, GRADIENT_BITS, group_size_for(chunk, block))
    if local > 1:
        inside.count("all_to_all", input, elements=local * nodes * chunk, wire_bytes=local * nodes * layout.piece_bytes)
        layout = Layout(layout.padded_numel, GRADIENT_BITS, layout.group_size)  # the partial sums, padded
    if nodes > 1:
        across.count("all_to_all", input, elements=nodes * chunk, wire_bytes=nodes * layout.piece_bytes)
    quantized_reduce_scatter(output, input, inside.group if local > 1 else None, across.group if nodes > 1 else None,
                             bits=GRADIENT_BITS, group_size=group_size_for(chunk, block))
    return _Done()
