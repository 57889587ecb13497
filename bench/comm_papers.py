"""The ZeRO++ and MiCS papers' published figures, and what bench/comm_model.py's model says at their settings.

Every published figure here is quoted with where it was read; nothing is filled in from memory. The
model's numbers beside them come from the same `step_time` as docs/scale.md's tables, with the
papers' hardware put into `Assumptions` (what the sources do not state is marked `assumed`).
"""
from __future__ import annotations

from dataclasses import asdict, replace
from typing import Any

from bench.comm_model import Assumptions, Layout, ModelSpec, collectives, node_egress, per_rank, step_time

ZEROPP_ABSTRACT = "ZeRO++ abstract"
ZEROPP_BLOG = "ZeRO++ blog"
MICS_ABSTRACT = "MiCS abstract"
SOURCES = {
    ZEROPP_ABSTRACT: "Wang et al., ZeRO++: Extremely Efficient Collective Communication for Giant Model Training "
                     "(2023), arXiv:2306.10209, abstract",
    ZEROPP_BLOG: "DeepSpeed's ZeRO++ blog (June 2023), as in the DeepSpeed repository's edition "
                 "(microsoft/DeepSpeed, blogs/zeropp/chinese/README.md): its volume table, qgZ section and "
                 "figures 6-8",
    MICS_ABSTRACT: "Zhang et al., MiCS: Near-linear Scaling for Training Gigantic Model on Public Cloud, PVLDB 16(1) "
                   "(VLDB 2023), arXiv:2205.00119, abstract; also the Amazon Science blog 'Near-linear scaling of "
                   "gigantic-model training on AWS'",
}
PUBLISHED = [
    {"paper": "ZeRO++", "figure": "communication volume of ZeRO reduced 4x; up to 2.16x throughput at 384 GPUs",
     "source": ZEROPP_ABSTRACT},
    {"paper": "ZeRO++", "figure": "cross-node volume per step: ZeRO-3 M + M + M = 3M (forward all-gather, backward "
     "all-gather, gradient reduce-scatter); ZeRO++ 0.5M + 0 + 0.25M = 0.75M (M: the model's bytes)",
     "source": ZEROPP_BLOG},
    {"paper": "ZeRO++", "figure": "qgZ's two hops: cross-node traffic per GPU from M/Z to M/(Z N) (Z: quantization "
     "ratio, N: GPUs per node)", "source": ZEROPP_BLOG},
    {"paper": "ZeRO++", "figure": "384 V100s, 4 x 100 Gbit/s InfiniBand (400 Gbit/s) between nodes: +28 % to +36 % "
     "throughput over ZeRO-3 at 1k tokens per GPU, +24 % to +29 % at 2k", "source": ZEROPP_BLOG},
    {"paper": "ZeRO++", "figure": "384 V100s at 100 Gbit/s between nodes: up to 2.2x over ZeRO-3, about 2x on average",
     "source": ZEROPP_BLOG},
    {"paper": "ZeRO++", "figure": "ZeRO++ at 200 Gbit/s reaches the TFLOPs of ZeRO-3 at 800 Gbit/s (18B and 138B models)",
     "source": ZEROPP_BLOG},
    {"paper": "MiCS", "figure": "system throughput up to 2.89x that of the state-of-the-art large model training "
     "systems; scaling efficiency up to 1.27x DeepSpeed's", "source": MICS_ABSTRACT},
    {"paper": "MiCS", "figure": "a 100B-parameter model on 512 GPUs at 99.4 % weak-scaling efficiency; over 54.5 % of "
     "each GPU's theoretical compute on a public cloud", "source": MICS_ABSTRACT},
    {"paper": "MiCS", "figure": "its speedups over ZeRO-3 broken down by bandwidth (100 / 400 Gbit/s): not quoted: the "
     "sources read here (the abstract, the opening of the Amazon Science blog) give only the figures above", "source": "—"},
]

# The ZeRO++ evaluation's hardware where the blog states it (384 V100s; 100 or 400 Gbit/s between nodes) and
# where it does not (assumed: 16 V100s per node as the ZeRO++ tutorial's DGX-2-class nodes, 125 TFLOP/s fp16
# tensor peak, NVLink 150 GB/s per direction, 40% MFU, an 18B model of 40 blocks).
V100_NODE = Assumptions(gpus_per_node=16, peak_tflops=125.0, nvlink_gbytes_per_s=150.0, mfu=0.40)
ZEROPP_MODEL = ModelSpec("18B", 18e9, 40)
ZEROPP_NODES = 24


def _speedup(layout: Layout, spec: ModelSpec, nodes: int, gbits: float, a: Assumptions,
             quantized: tuple[float, float], coefficient: dict, baseline_gbits: float | None = None) -> float:
    flat = step_time(Layout("flat"), spec, nodes, baseline_gbits or gbits, a, quantized, coefficient)["step_s"]
    return flat / step_time(layout, spec, nodes, gbits, a, quantized, coefficient)["step_s"]


def papers(quantized: tuple[float, float], coefficient: dict) -> dict[str, Any]:
    """The published figures, and the model's figure for each where it can give one."""
    zeropp = Layout("zeropp", 16)
    flat_items = collectives(Layout("flat"), ZEROPP_NODES, 16, 2, quantized)
    plus_items = collectives(zeropp, ZEROPP_NODES, 16, 2, quantized)
    egress = sum(node_egress(i, 16) for i in flat_items) / sum(node_egress(i, 16) for i in plus_items)
    inter = (sum(v["inter_node_bytes"] for v in per_rank(flat_items).values())
             / sum(v["inter_node_bytes"] for v in per_rank(plus_items).values()))
    model = []
    model.append({"setting": f"cross-node volume, flat / hpZ+qwZ+qgZ, {ZEROPP_NODES} nodes x 16",
                  "published": "4x (3M / 0.75M)", "model": f"{egress:.2f}x out of each node (ring); {inter:.2f}x of "
                  "each rank's point-to-point count (the engine's)"})
    for gbits, tokens, published in ((400, 1024, "1.28-1.36x"), (400, 2048, "1.24-1.29x"),
                                     (100, 1024, "up to 2.2x (2.16x), ~2x average"),
                                     (100, 2048, "up to 2.2x (2.16x), ~2x average")):
        a = replace(V100_NODE, tokens_per_gpu=tokens)
        got = _speedup(zeropp, ZEROPP_MODEL, ZEROPP_NODES, gbits, a, quantized, coefficient)
        model.append({"setting": f"384 V100s, {gbits} Gbit/s, {tokens} tokens per GPU, 18B: hpZ+qwZ+qgZ over flat",
                      "published": published, "model": f"{got:.2f}x"})
    for overlap in (0.0, 1.0):
        a = replace(V100_NODE, tokens_per_gpu=1024, overlap=overlap)
        got = _speedup(zeropp, ZEROPP_MODEL, ZEROPP_NODES, 100, a, quantized, coefficient)
        model.append({"setting": f"the same at 100 Gbit/s, 1k tokens, overlap {overlap:g}", "published": "up to 2.2x",
                      "model": f"{got:.2f}x"})
    a = replace(V100_NODE, tokens_per_gpu=2048)
    ratio = _speedup(zeropp, ZEROPP_MODEL, ZEROPP_NODES, 200, a, quantized, coefficient, baseline_gbits=800)
    model.append({"setting": "hpZ+qwZ+qgZ at 200 Gbit/s against flat at 800 Gbit/s, 18B, 2k tokens",
                  "published": "similar TFLOPs", "model": f"{ratio:.2f}x the throughput"})
    a = Assumptions()
    spec = ModelSpec("7B", 7e9, 32)
    for gbits in (100, 400):
        for layout in (Layout("mics", 8), Layout("mics", 16, hierarchical=True)):
            small = step_time(layout, spec, 2, gbits, a, quantized, coefficient)["step_s"]
            large = step_time(layout, spec, 64, gbits, a, quantized, coefficient)["step_s"]
            flat_small = step_time(Layout("flat"), spec, 2, gbits, a, quantized, coefficient)["step_s"]
            flat_large = step_time(Layout("flat"), spec, 64, gbits, a, quantized, coefficient)["step_s"]
            model.append({"setting": f"7B, 8 H100s per node, {gbits} Gbit/s: {layout.label} over flat at 512 GPUs; "
                          "weak scaling 16 -> 512 GPUs", "published": "up to 2.89x; 99.4 % (100B, 512 GPUs)",
                          "model": f"{flat_large / large:.2f}x; {layout.label} {small / large:.1%}, "
                          f"flat {flat_small / flat_large:.1%}"})
    return {"published": PUBLISHED, "sources": SOURCES, "model": model,
            "assumed_v100": asdict(V100_NODE), "assumed_zeropp_model": asdict(ZEROPP_MODEL)}


SENSITIVITY_POINT = (ModelSpec("7B", 7e9, 32), 32, 400)


def sensitivity(a: Assumptions, quantized: tuple[float, float], coefficient: dict) -> list[dict[str, Any]]:
    """Step time of each layout at one point (7B, 32 nodes, 400 Gbit/s) as one assumption changes."""
    from bench.comm_model import LAYOUTS

    spec, nodes, gbits = SENSITIVITY_POINT
    variants = [("as assumed", a), ("overlap 0 (nothing hidden)", replace(a, overlap=0.0)),
                ("overlap 1 (hidden up to the compute time)", replace(a, overlap=1.0)),
                ("alpha 0 (bandwidth only)", replace(a, alpha_inter_us=0.0, alpha_intra_us=0.0)),
                ("alpha x 4 (20 us across nodes)", replace(a, alpha_inter_us=20.0, alpha_intra_us=4.0)),
                ("16,384 tokens per GPU", replace(a, tokens_per_gpu=16384)),
                ("MFU 0.55", replace(a, mfu=0.55))]
    out = []
    for name, assumed in variants:
        steps = {layout.label: step_time(layout, spec, nodes, gbits, assumed, quantized, coefficient)["step_s"]
                 for layout in LAYOUTS}
        out.append({"variant": name, "model": spec.name, "nodes": nodes, "node_gbits": gbits, "step_s": steps})
    return out
