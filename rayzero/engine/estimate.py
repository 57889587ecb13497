"""`rayzero estimate`: bytes of model state per device, per host and on NVMe for every ZeRO stage and
offload option — DeepSpeed's `estimate_zero2/3_model_states_mem_needs_all_live`, for this engine's
actual layout (which tensors exist, which alias, where [Note: offload placement] puts them).

Per rank, with Ψ trainable parameters, N ranks, p bytes per compute element (2 for bf16/fp16,
4 for fp32), s bytes of optimizer state per element (Adam 8, SGD with momentum 4):

  stage  compute params  compute grads  fp32 master  fp32 master grad  optimizer state
  0      Ψp              Ψp             4Ψ           4Ψ                sΨ
  1      Ψp              Ψp             4Ψ/N         4Ψ/N              sΨ/N
  2      Ψp              -              4Ψ/N         4Ψ/N              sΨ/N
  3      Ψp/N            -              4Ψ/N         4Ψ/N              sΨ/N

fp32 without optimizer offload aliases the master with the parameter (and at stages 0-1 the master
gradient with the gradient buffer): those columns are then 0. At stage 3 without offload the shard
*is* the fp32 master in every precision ([Note: shards are the masters] in stage3/strategy.py): the
parameter column is 4Ψ/N and the master column 0. Offloading moves master, master
gradient and optimizer state to the host (`cpu`) or the optimizer state to NVMe (`nvme`, masters
stay on the host); `offload_param` moves stage 3's parameter shards to the host (`cpu`) or to NVMe
(`nvme`, with `max_in_cpu` 0: every shard). Working memory (stage 2's two staging buckets, stage 3's
gathered layers, NVMe parameter staging buffers) is reported apart from model state.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from dataclasses import asdict, dataclass

GIB = 1 << 30
OPTIONS = (("none", "none"), ("cpu", "none"), ("nvme", "none"), ("cpu", "cpu"), ("nvme", "cpu"), ("nvme", "nvme"))
"""(offload_optimizer, offload_param) combinations; offload_param needs stage 3."""
PARAM_STAGING_BUFFERS = 5
"""offload_param.buffer_count's default: the staging buffers an NVMe parameter shard is read into."""


@dataclass(frozen=True)
class Estimate:
    stage: int
    offload_optimizer: str
    offload_param: str
    device_bytes: int
    """Model state on each accelerator (per rank)."""
    host_bytes_per_rank: int
    host_bytes_per_node: int
    nvme_bytes_per_node: int
    working_bytes: int
    """Per rank, on the device, besides model state: gradient staging / gathered parameters."""
    deepspeed_device_bytes: int | None
    """DeepSpeed 0.19.8's own estimate for the same stage and offload (fp16, Adam), for comparison."""
    deepspeed_host_bytes_per_node: int | None


def estimate(params: int, largest_layer: int, gpus_per_node: int = 1, nodes: int = 1, precision: str = "bf16",
             optimizer_state_bytes: int = 8, reduce_bucket_size: int = 500_000_000,
             communication_data_type: str | None = None) -> list[Estimate]:
    """Every stage × offload option for a model of `params` trainable elements. Gradients are
    reduced in `communication_data_type` (the config key; default: the compute dtype)."""
    world = gpus_per_node * nodes
    p = 4 if precision == "fp32" else 2
    r = p if communication_data_type is None else 4 if communication_data_type == "fp32" else 2
    out = []
    for stage in range(4):
        for opt_off, param_off in OPTIONS:
            if param_off != "none" and stage != 3 or opt_off != "none" and stage == 0:
                continue
            out.append(_one(stage, opt_off, param_off, params, largest_layer, world, gpus_per_node, p,
                            optimizer_state_bytes, reduce_bucket_size, r))
    return out


def _one(stage, opt_off, param_off, psi, largest, world, per_node, p, s, bucket, r) -> Estimate:
    shard = 1 if stage == 0 else world
    aliased = opt_off == "none" and param_off == "none" and (p == 4 or stage == 3)
    shard_p = 4 if aliased and stage == 3 else p  # [Note: shards are the masters]
    params = psi * shard_p // (world if stage == 3 else 1)
    grads = psi * p if stage < 2 else 0
    master = 0 if aliased else 4 * psi // shard
    master_grad = 0 if aliased and stage < 2 else 4 * psi // shard
    state = s * psi // shard
    where = {"device": 0, "host": 0, "nvme": 0}
    where[{"none": "device", "cpu": "host", "nvme": "nvme"}[param_off]] += params
    where["device"] += grads
    home = "device" if opt_off == "none" else "host"
    where[home] += master + master_grad
    where["nvme" if opt_off == "nvme" else home] += state
    working = 0
    if stage == 2:
        # the staging pair is two buckets in the reduce dtype; a parameter larger than
        # reduce_bucket_size is a bucket of its own (partition.plan_buckets) with a staging buffer of
        # its own while it reduces, beside its full gradient in the compute dtype (bucketed/stage2.py)
        ring = min(bucket, psi)
        working = 2 * ring * r + (largest * (p + r) if largest > ring else 0)
    elif stage == 3:
        # the largest layer gathered and its full gradient (compute dtype); that gradient copied into
        # a send buffer when reduced in another dtype ([Note: gradients copied on arrival]); the
        # bucket before it still in flight
        working = 2 * largest * p + (largest * r if r != p else 0) + min(bucket, psi) * r
        if param_off == "nvme":  # host buffers holding a shard each: the largest layer's, at most
            working += PARAM_STAGING_BUFFERS * -(-largest // world) * p
    ds_device, ds_host = _deepspeed(stage, opt_off != "none", param_off != "none", psi, largest, per_node,
                                    world // per_node)
    return Estimate(stage, opt_off, param_off, where["device"], where["host"], where["host"] * per_node,
                    where["nvme"] * per_node, working, ds_device, ds_host)


def _deepspeed(stage, cpu_offload, offload_params, psi, largest, per_node, nodes) -> tuple[int | None, int | None]:
    """deepspeed.runtime.zero.stage_1_and_2 / stage3 `estimate_*_model_states_mem_needs` (zero_init
    and additional_buffer_factor 1.5 as its `_all_live` wrappers print)."""
    factor, total = 1.5, per_node * nodes
    if stage in (1, 2):
        if cpu_offload:
            return 2 * psi, int(psi * max(4 * total, 16) * factor)
        return 2 * psi + int(18 * psi / total), int(psi * 4 * per_node * factor)
    if stage == 3:
        largest_mem = 4 * largest
        if cpu_offload and offload_params:
            return largest_mem, int(psi * 18 / nodes * factor)
        if cpu_offload:
            return largest_mem + int(2 * psi / total), int(psi * 16 / nodes * factor)
        return largest_mem + int(18 * psi / total), int(largest * 4 * per_node * factor)
    return None, None


def count_model(spec: str) -> tuple[int, int]:
    """(trainable parameters, largest module's own parameters) of `module:fn()`, built on the meta
    device so no memory is allocated (the model can be far larger than this machine)."""
    import torch

    module_name, _, attr = spec.partition(":")
    if not attr:
        raise SystemExit(f"rayzero estimate: --model {spec!r} must be MODULE:FUNCTION (a function returning "
                         "the torch.nn.Module)")
    with torch.device("meta"):
        model = getattr(importlib.import_module(module_name), attr)()
    seen, total = set(), 0
    for param in model.parameters():
        if param.requires_grad and id(param) not in seen:
            seen.add(id(param))
            total += param.numel()
    largest = max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)
    return total, largest


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayzero estimate", description=__doc__.split("\n\n")[0])
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--params", type=float, help="trainable parameters, e.g. 7e9")
    what.add_argument("--model", help="MODULE:FUNCTION returning the model (built on the meta device)")
    parser.add_argument("--largest-layer", type=float, default=None,
                        help="parameters of the largest layer (stage 3's gathered working set; default Ψ/100)")
    parser.add_argument("--gpus-per-node", type=int, default=1)
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    parser.add_argument("--communication-data-type", choices=("bf16", "fp16", "fp32"), default=None,
                        help="the config's communication_data_type: the dtype gradients are reduced in "
                             "(default: the precision's)")
    parser.add_argument("--optimizer", choices=("adam", "sgd"), default="adam",
                        help="adam keeps 8 bytes of state per element, sgd with momentum 4")
    parser.add_argument("--device-memory", type=float, default=None,
                        help="GiB per accelerator, to mark what fits (default: this machine's GPU 0, if any)")
    parser.add_argument("--host-memory", type=float, default=None,
                        help="GiB of host memory per node (default: this machine's)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.model:
        params, largest = count_model(args.model)
    else:
        params = int(args.params)
        largest = int(args.largest_layer) if args.largest_layer else max(params // 100, 1)
    for flag, value in (("--params", params), ("--gpus-per-node", args.gpus_per_node), ("--nodes", args.nodes)):
        if value <= 0:
            print(f"rayzero estimate: {flag} must be positive (got {value})", file=sys.stderr)
            return 2
    rows = estimate(params, largest, args.gpus_per_node, args.nodes, args.precision,
                    8 if args.optimizer == "adam" else 4, communication_data_type=args.communication_data_type)
    device_from, host_from = "--device-memory", "--host-memory"
    if args.device_memory is None:
        args.device_memory, device_from = _local_device_gib(), "this machine's GPU 0"
    if args.host_memory is None:
        args.host_memory, host_from = _local_host_gib(), "this machine"

    def fits(row: Estimate) -> bool | None:
        if args.device_memory is None:  # no accelerator here and none named: cannot say
            return None
        device_ok = args.device_memory is None or row.device_bytes + row.working_bytes <= args.device_memory * GIB
        host_ok = args.host_memory is None or row.host_bytes_per_node <= args.host_memory * GIB
        return device_ok and host_ok

    if args.json:
        print(json.dumps({"params": params, "largest_layer": largest, "gpus_per_node": args.gpus_per_node,
                          "nodes": args.nodes, "precision": args.precision,
                          "rows": [{**asdict(r), "fits": fits(r)} for r in rows]}, indent=2))
        return 0
    print(f"{params / 1e9:.3g}B parameters (largest layer {largest / 1e6:.3g}M), {args.nodes} node(s) x "
          f"{args.gpus_per_node} GPU(s), {args.precision}, {args.optimizer}; GiB of model state:")
    print(f"{'stage':>5} {'offload opt':>11} {'offload param':>13} {'per device':>10} {'+working':>9} "
          f"{'host/node':>10} {'nvme/node':>10} {'DeepSpeed dev':>13} {'fits':>5}")
    for row in rows:
        ok = fits(row)
        ds = "" if row.deepspeed_device_bytes is None else f"{row.deepspeed_device_bytes / GIB:.2f}"
        print(f"{row.stage:>5} {row.offload_optimizer:>11} {row.offload_param:>13} {row.device_bytes / GIB:>10.2f} "
              f"{row.working_bytes / GIB:>9.2f} {row.host_bytes_per_node / GIB:>10.2f} "
              f"{row.nvme_bytes_per_node / GIB:>10.2f} {ds:>13} {'?' if ok is None else 'yes' if ok else 'no':>5}")
    if args.device_memory is None:
        print("fits: ? - this machine has no accelerator; give --device-memory GiB (per GPU) to mark what fits")
    else:
        host = f", host {args.host_memory:.0f} GiB per node ({host_from})" if args.host_memory else ""
        print(f"fits: device {args.device_memory:.0f} GiB ({device_from}){host}")
    return 0


def _local_device_gib() -> float | None:
    """GPU 0's memory here, in GiB (None without one)."""
    try:
        import torch

        if torch.cuda.is_available():
            return torch.cuda.get_device_properties(0).total_memory / GIB
    except (ImportError, RuntimeError):
        pass
    return None


def _local_host_gib() -> float | None:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GIB
    except (ValueError, OSError):
        return None


if __name__ == "__main__":
    sys.exit(main())
