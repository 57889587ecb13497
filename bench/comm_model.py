"""Scale on paper: the communication of ZeRO-3's layouts per link class, measured, fitted, then timed.

    python bench/comm_model.py --measure [--topologies 2x2,2x4,4x2]   # run the engine, fit, model, write JSON
    python bench/comm_model.py                       # refit + remodel from the stored measurement
    python bench/comm_model.py --doc docs/scale.md [--check]   # section 3's tables from the JSON

[Note: communication model]
(a) Measured. bench/comm_measure.py runs the real engine on emulated nodes (gloo, CPU) for each layout
and reads, per collective kind, the bytes each rank sent to peers on its node and on other nodes
([Note: bytes per link class] in rayzero/engine/comm.py). `collectives` below states, per layout, the
collectives of one step as (kind, group shape, bytes of the counted tensor per model parameter); the
same point-to-point rule as the engine's turns them into bytes per parameter per rank per link class
(`per_rank`). `fit` regresses the measured bytes on that formula over every (nodes, ranks per node,
K) measured, per layout, kind and link: the coefficient is 1 where the engine sends what the formula
says. A quantized layout the engine does not quantize yet (it reports bytes per element of the
compute dtype) is compared against the unquantized formula, and its quantized collectives are
modelled from the formula alone, labelled `analytic` — measured again, the engine's counts take
over by themselves once it quantizes (`engine_quantizes`).

(b) Modelled. Per step: compute = 6 Ψ tokens / (peak x MFU); each collective costs
    calls x ring steps x alpha  +  max(node egress / node bandwidth, NVLink bytes / NVLink bandwidth)
where the node egress is what leaves a node under NCCL's ring algorithm — each ring crosses each
node boundary once, so a group with g_l members per node and g members in all moves c T (g-1)/g
bytes out of the node per ring, with L/g_l rings per node (c = 2 for an all-reduce). That is less
than the engine's point-to-point count summed over the node's ranks (a ring forwards a piece once
per node, not once per rank: the factor is about g_l), which is why the model converts the
measured per-rank bytes instead of dividing them by the bandwidth directly; for a group of one rank
per node (MiCS's replicas, qgZ's second stage, the hierarchical gather's first) the two agree. The
step is compute + max(0, comm - overlap x compute): `overlap` is the share of the compute time
under which communication can hide (prefetched gathers, reduce-scatters behind backward).
"""
from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

REPOSITORY = Path(__file__).resolve().parent.parent
if str(REPOSITORY) not in sys.path:  # `python bench/comm_model.py` puts bench/, not the repository, on the path
    sys.path.insert(0, str(REPOSITORY))

RESULTS = REPOSITORY / "bench" / "results" / "comm_model.json"
KINDS = ("all_gather", "reduce_scatter", "all_reduce", "all_to_all")
LINKS = ("intra_node_bytes", "inter_node_bytes")
FIT_TOLERANCE = 0.01
"""A coefficient within 1 % of 1 (and every point within 1 % of the fitted line) is a match."""

MODEL_WIDTH = 4096
"""The layer width qgZ's blocks follow at the modelled scale (7B: 4096; 70B's 8192 is capped at 4096)."""


def elements_per_scale(width: int = MODEL_WIDTH) -> tuple[int, int, str]:
    """(qwZ, qgZ) elements per fp32 scale for layers `width` wide, and where they come from: the engine's
    own constants and rule (qgZ's blocks follow the layer width: [Note: qgZ block size])."""
    from rayzero.engine.stage3.gather_routes import WEIGHT_BLOCK
    from rayzero.engine.stage3.gradients import qgz_block_size

    return (WEIGHT_BLOCK, qgz_block_size([(width, width)]),
            f"rayzero.engine.stage3.gather_routes.WEIGHT_BLOCK, gradients.qgz_block_size at width {width}")


# ---- layouts and their collectives ------------------------------------------------------------------
@dataclass(frozen=True)
class Layout:
    family: str
    """flat | hpz | mics | zeropp (hpZ + qwZ + qgZ)."""
    size: int = 0
    """K: ranks per hpZ group or MiCS shard group (0: none)."""
    hierarchical: bool = False
    """MiCS's hierarchical gather (a shard group spanning nodes)."""

    @property
    def quantized(self) -> bool:
        return self.family == "zeropp"

    @property
    def label(self) -> str:
        if self.family == "flat":
            return "flat"
        if self.family == "mics":
            return f"MiCS({self.size}{', hier.' if self.hierarchical else ''})"
        return f"hpZ({self.size})" + ("+qwZ+qgZ" if self.quantized else "")

    @property
    def fit_key(self) -> str:
        return self.family + ("-hier" if self.hierarchical else "")

    def zero(self) -> dict[str, Any]:
        """The zero_optimization keys that ask for this layout."""
        if self.family == "mics":
            return {"mics_shard_size": self.size, **({"mics_hierarchical_params_gather": True} if self.hierarchical else {})}
        out: dict[str, Any] = {"zero_hpz_partition_size": self.size} if self.size > 1 else {}
        if self.quantized:
            out.update(zero_quantized_weights=True, zero_quantized_gradients=True)
        return out


@dataclass(frozen=True)
class Collective:
    kind: str
    what: str
    group_nodes: int
    group_local: int
    """Members of the group on each node it spans."""
    tensor_bytes: float
    """Bytes of the tensor the engine counts for this collective, per model parameter."""
    calls: str
    """What its number of calls per step follows in the time model: `blocks` (one gather per
    transformer block per pass) or `buckets` (one per gradient bucket)."""

    @property
    def size(self) -> int:
        return self.group_nodes * self.group_local

    @property
    def factor(self) -> int:
        return 2 if self.kind == "all_reduce" else 1


def _group(size: int, local: int) -> tuple[int, int]:
    """(nodes, ranks per node) of a group of `size` consecutive ranks."""
    return (1, size) if size <= local else (size // local, local)


def collectives(layout: Layout, nodes: int, local: int, element_bytes: float, quantized: tuple[float, float],
                quantize: tuple[bool, bool] | None = None, two_stage_reduce: bool = False) -> list[Collective]:
    """One micro-batch's collectives under `layout` on nodes x local ranks ([Note: stage-3 layouts]).
    `quantized`: bytes per element of a qwZ int8 and a qgZ int4 piece, scales included; `quantize`:
    (weights, gradients) to override what the layout asks for (what the engine really did);
    `two_stage_reduce`: a reduction spanning nodes runs inside the node, then across (the engine on
    gloo: [Note: two-stage reduce-scatter on gloo]); the modelled GPUs keep NCCL's one reduce-scatter."""
    world = nodes * local
    weights, gradients = quantize if quantize is not None else (layout.quantized, layout.quantized)
    gather = quantized[0] if weights else element_bytes
    shard = layout.size if layout.family == "mics" else world
    primary = _group(shard, local)
    out = []
    for phase in ("forward", "backward"):
        if layout.hierarchical and shard > local:  # [Note: hierarchical gather]: across, then inside
            out.append(Collective("all_gather", f"{phase} gather, across nodes", shard // local, 1, gather / local, "blocks"))
            out.append(Collective("all_gather", f"{phase} gather, inside the node", 1, local, gather, "blocks"))
            continue
        group = _group(layout.size, local) if phase == "backward" and layout.family in ("hpz", "zeropp") else primary
        out.append(Collective("all_gather", f"{phase} gather", *group, gather, "blocks"))
    if gradients:  # qgZ: int4 all-to-all inside the node, then across nodes between equal local indices
        if local > 1:
            out.append(Collective("all_to_all", "gradients, int4, inside the node", 1, min(local, shard), quantized[1], "buckets"))
        if nodes > 1:
            out.append(Collective("all_to_all", "gradients, int4, across nodes", nodes, 1, quantized[1] / local, "buckets"))
    elif two_stage_reduce and primary[0] > 1:
        if local > 1:
            out.append(Collective("reduce_scatter", "gradients, inside the node", 1, local, element_bytes, "buckets"))
        out.append(Collective("reduce_scatter", "gradients, across nodes", primary[0], 1, element_bytes / local, "buckets"))
    else:
        out.append(Collective("reduce_scatter", "gradient reduce-scatter", *primary, element_bytes, "buckets"))
    if layout.family == "mics" and shard < world:  # each gradient shard all-reduced across the replicas
        per_node = max(1, local // shard)
        out.append(Collective("all_reduce", "replica all-reduce", world // shard // per_node, per_node,
                              element_bytes / shard, "buckets"))
    return out


def per_rank(items: list[Collective]) -> dict[str, dict[str, float]]:
    """Bytes per model parameter each rank sends, by kind and link class: the engine's rule ([Note:
    bytes per link class]): c T/g to each peer, split by where the peer runs."""
    out: dict[str, dict[str, float]] = {}
    for item in items:
        per_peer = item.factor * item.tensor_bytes / item.size
        links = out.setdefault(item.kind, dict.fromkeys(LINKS, 0.0))
        links["intra_node_bytes"] += per_peer * (item.group_local - 1)
        links["inter_node_bytes"] += per_peer * (item.size - item.group_local)
    return out


def node_egress(item: Collective, local: int) -> float:
    """Bytes per parameter that leave one node under a ring ([Note: communication model])."""
    if item.group_nodes == 1:
        return 0.0
    return (local / item.group_local) * item.factor * item.tensor_bytes * (item.size - 1) / item.size


def nvlink_bytes(item: Collective) -> float:
    """Bytes per parameter one GPU sends over NVLink under a ring (0 for one rank per node)."""
    if item.group_local == 1:
        return 0.0
    return item.factor * item.tensor_bytes * (item.size - 1) / item.size


# ---- (a) measured: compare and fit ----------------------------------------------------------------
def measured_layouts() -> dict[tuple[int, int], list[tuple[Layout, int]]]:
    """(nodes, ranks per node) -> (layout, gradient accumulation steps) measured there."""
    def common(local: int, nodes: int) -> list[tuple[Layout, int]]:
        world = nodes * local
        rows = [(Layout("flat"), 1), (Layout("hpz", local), 1), (Layout("mics", local), 1),
                (Layout("mics", 2 * local, hierarchical=True), 1), (Layout("zeropp", local), 1)]
        if 2 * local < world:
            rows.append((Layout("mics", 2 * local), 1))
        return rows

    return {(2, 2): common(2, 2) + [(Layout("mics", 2), 2)],
            (2, 4): common(4, 2) + [(Layout("hpz", 2), 1), (Layout("mics", 2), 1)],
            (4, 2): common(2, 4)}


def engine_quantizes(kinds: dict[str, dict[str, float]], element_bytes: float) -> tuple[bool, bool]:
    """(weights, gradients): does the engine's count show int8 gathers / the int4 all-to-all?"""
    gather = kinds.get("all_gather", {})
    weights = bool(gather.get("elements")) and gather["bytes"] < 0.75 * element_bytes * gather["elements"]
    return weights, bool(kinds.get("all_to_all", {}).get("bytes"))


def compare(measurement: dict[str, Any], quantized: tuple[float, float]) -> list[dict[str, Any]]:
    """Per measured row, kind and link: measured bytes per parameter per rank and the formula's."""
    psi, element = measurement["parameters"], measurement["element_bytes"]
    points = []
    for row in measurement["rows"]:
        if "error" in row:
            continue
        layout = Layout(**row["layout"])
        nodes, local, gas = row["nodes"], row["local"], row["gas"]
        did = engine_quantizes(row["kinds"], element)
        formula = per_rank(collectives(layout, nodes, local, element, quantized, quantize=did,
                                       two_stage_reduce=bool(measurement.get("two_stage_reduce"))))
        for kind in sorted(set(formula) | set(row["kinds"])):
            for link in LINKS:
                got = row["kinds"].get(kind, {}).get(link, 0.0) / psi
                # every collective per micro-batch, but MiCS's replica all-reduce once a step ([Note: MiCS
                # replicas sync once a step] in rayzero/engine/stage3/gradients.py)
                want = (1 if kind == "all_reduce" else gas) * formula.get(kind, {}).get(link, 0.0)
                points.append({"layout": layout.label, "fit_key": layout.fit_key, "nodes": nodes, "local": local,
                               "gas": gas, "kind": kind, "link": link, "measured": got, "formula": want,
                               "spread": row["spread"].get(kind, {}).get(link, 0.0) / psi,
                               "quantized_by_engine": list(did) if layout.quantized else None})
    return points


def fit(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Least squares through the origin of measured on formula, per (layout family, kind, link)."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for point in points:
        groups.setdefault((point["fit_key"], point["kind"], point["link"]), []).append(point)
    out = []
    for (key, kind, link), members in sorted(groups.items()):
        denominator = sum(p["formula"] ** 2 for p in members)
        if denominator == 0:
            coefficient = None if any(p["measured"] for p in members) else 1.0
            residual = max(p["measured"] for p in members)
        else:
            coefficient = sum(p["measured"] * p["formula"] for p in members) / denominator
            residual = max(abs(p["measured"] - coefficient * p["formula"]) for p in members) / max(
                p["formula"] for p in members)
        matches = coefficient is not None and abs(coefficient - 1) <= FIT_TOLERANCE and residual <= FIT_TOLERANCE
        out.append({"fit_key": key, "kind": kind, "link": link, "points": len(members), "coefficient": coefficient,
                    "max_residual": residual, "matches_formula": matches})
    return out


def coefficients(fitted: list[dict[str, Any]]) -> dict[tuple[str, str, str], float]:
    return {(f["fit_key"], f["kind"], f["link"]): f["coefficient"] for f in fitted if f["coefficient"] is not None}


# ---- (b) modelled: step time -----------------------------------------------------------------------
@dataclass(frozen=True)
class Assumptions:
    gpus_per_node: int = 8
    peak_tflops: float = 989.0
    """H100 SXM dense bf16."""
    mfu: float = 0.40
    """Utilisation of the compute kernels alone (communication not included)."""
    tokens_per_gpu: int = 4096
    """Per optimizer step (one micro-batch: gradient accumulation 1)."""
    nvlink_gbytes_per_s: float = 450.0
    """Per GPU and direction (H100's 900 GB/s NVLink is both directions together)."""
    alpha_inter_us: float = 5.0
    alpha_intra_us: float = 1.0
    """Latency per ring step crossing nodes / inside a node."""
    overlap: float = 0.5
    """Share of the compute time under which communication can hide (prefetched gathers, reduce-scatters
    behind backward): step = compute + max(0, comm - overlap x compute). Not measured: see the sensitivity."""
    bucket_elements: float = 5e8
    """DeepSpeed's reduce_bucket_size default: gradient collectives per step = ceil(Ψ / this)."""
    element_bytes: int = 2
    hbm_gbytes: float = 80.0
    """Model states per GPU above this are flagged: they do not fit (activations not even counted)."""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    parameters: float
    blocks: int
    """Transformer blocks: gathers per pass = blocks + 2 (embedding, head)."""


MODELS = (ModelSpec("7B", 7e9, 32), ModelSpec("70B", 70e9, 80))
NODES = (2, 4, 8, 16, 32, 64, 128)
NODE_GBITS = (100, 400, 3200)
LAYOUTS = (Layout("flat"), Layout("hpz", 8), Layout("mics", 8), Layout("mics", 16, hierarchical=True),
           Layout("zeropp", 8))


def model_state_gbytes(layout: Layout, parameters: float, world: int) -> float:
    """bf16 parameters and gradients, fp32 masters and Adam's two moments (16 bytes) sharded over the
    shard group, plus hpZ's bf16 secondary shard over its group."""
    shard = layout.size if layout.family == "mics" else world
    secondary = 2 * parameters / layout.size if layout.family in ("hpz", "zeropp") else 0.0
    return (16 * parameters / shard + secondary) / 1e9


def step_time(layout: Layout, spec: ModelSpec, nodes: int, node_gbits: float, a: Assumptions,
              quantized: tuple[float, float], coefficient: dict[tuple[str, str, str], float]) -> dict[str, Any]:
    local = a.gpus_per_node
    items = collectives(layout, nodes, local, a.element_bytes, quantized)
    calls = {"blocks": spec.blocks + 2, "buckets": math.ceil(spec.parameters / a.bucket_elements)}
    node_bytes_per_s, nvlink_per_s = node_gbits * 1e9 / 8, a.nvlink_gbytes_per_s * 1e9
    bandwidth = latency = egress_total = 0.0
    for item in items:
        # The measured/formula coefficient of this kind's bytes (1 where they agree; 1 for analytic parts).
        scale_inter = coefficient.get((layout.fit_key, item.kind, "inter_node_bytes"), 1.0)
        scale_intra = coefficient.get((layout.fit_key, item.kind, "intra_node_bytes"), 1.0)
        egress = node_egress(item, local) * scale_inter * spec.parameters
        egress_total += egress
        bandwidth += max(egress / node_bytes_per_s, nvlink_bytes(item) * scale_intra * spec.parameters / nvlink_per_s)
        steps = (item.size - 1) * item.factor
        alpha = a.alpha_inter_us if item.group_nodes > 1 else a.alpha_intra_us
        latency += calls[item.calls] * steps * alpha * 1e-6
    compute = 6 * spec.parameters * a.tokens_per_gpu / (a.peak_tflops * 1e12 * a.mfu)
    comm = bandwidth + latency
    exposed = max(0.0, comm - a.overlap * compute)
    memory = model_state_gbytes(layout, spec.parameters, nodes * local)
    return {"model": spec.name, "nodes": nodes, "gpus": nodes * local, "node_gbits": node_gbits, "layout": layout.label,
            "compute_s": compute, "comm_bandwidth_s": bandwidth, "comm_latency_s": latency, "exposed_s": exposed,
            "step_s": compute + exposed, "node_egress_gbytes": egress_total / 1e9, "model_state_gbytes": memory,
            "fits": memory <= a.hbm_gbytes}


def grid(a: Assumptions, quantized: tuple[float, float], coefficient: dict[tuple[str, str, str], float],
         models: tuple[ModelSpec, ...] = MODELS, nodes: tuple[int, ...] = NODES,
         gbits: tuple[float, ...] = NODE_GBITS, layouts: tuple[Layout, ...] = LAYOUTS) -> list[dict[str, Any]]:
    rows = []
    for spec in models:
        for bandwidth in gbits:
            for count in nodes:
                flat = None
                for layout in layouts:
                    if layout.family == "mics" and (count * a.gpus_per_node) % layout.size:
                        continue
                    row = step_time(layout, spec, count, bandwidth, a, quantized, coefficient)
                    flat = flat or row["step_s"]
                    row["speedup_vs_flat"] = flat / row["step_s"]
                    rows.append(row)
    return rows


def volumes(quantized: tuple[float, float], local: int = 8, nodes: int = 16, element_bytes: int = 2) -> list[dict[str, Any]]:
    """Per layout at nodes x local: bytes per parameter per rank by link (the engine's count) and out of a
    node under a ring, in units of the compute dtype's bytes (the papers' M = Ψ x 2 bytes)."""
    out = []
    for layout in LAYOUTS:
        items = collectives(layout, nodes, local, element_bytes, quantized)
        counted = per_rank(items)
        out.append({"layout": layout.label, "nodes": nodes, "local": local,
                    "rank_intra_M": sum(v["intra_node_bytes"] for v in counted.values()) / element_bytes,
                    "rank_inter_M": sum(v["inter_node_bytes"] for v in counted.values()) / element_bytes,
                    "node_egress_M": sum(node_egress(i, local) for i in items) / element_bytes,
                    "collectives": [asdict(i) for i in items]})
    return out


def build(measurement: dict[str, Any] | None) -> dict[str, Any]:
    """Everything docs/scale.md section 3 shows, from a measurement (None: formulas only)."""
    from bench import comm_papers

    qwz_group, qgz_group, source = elements_per_scale()
    quantized = (1 + 4 / qwz_group, 0.5 + 4 / qgz_group)
    # the measured model's layers are narrower: qgZ's blocks there follow its width
    from bench import comm_measure

    measured_qwz, measured_qgz, _ = elements_per_scale(comm_measure.WIDTH)
    points = compare(measurement, (1 + 4 / measured_qwz, 0.5 + 4 / measured_qgz)) if measurement else []
    fitted = fit(points)
    coefficient = coefficients(fitted)
    honoured = [p["quantized_by_engine"] for p in points if p["quantized_by_engine"] is not None]
    a = Assumptions()
    rows = grid(a, quantized, coefficient)
    return {
        "benchmark": "comm_model",
        "measurement": measurement,
        "quantization": {"qwz_elements_per_scale": qwz_group, "qgz_elements_per_scale": qgz_group, "source": source,
                         "qwz_bytes_per_element": quantized[0], "qgz_bytes_per_element": quantized[1],
                         "engine_quantizes_weights": any(h[0] for h in honoured),
                         "engine_quantizes_gradients": any(h[1] for h in honoured)},
        "points": points,
        "fit": fitted,
        "assumptions": asdict(a),
        "models": [asdict(m) for m in MODELS],
        "volumes": volumes(quantized),
        "rows": rows,
        "sensitivity": comm_papers.sensitivity(a, quantized, coefficient),
        "papers": comm_papers.papers(quantized, coefficient),
    }


def measure(topologies: list[tuple[int, int]]) -> dict[str, Any]:
    from bench import comm_measure

    plan = measured_layouts()
    rows = []
    for nodes, local in topologies:
        cases = plan[(nodes, local)]
        print(f"measuring {nodes} nodes x {local} ranks: {', '.join(l.label for l, _ in cases)}", file=sys.stderr, flush=True)
        results = comm_measure.run_topology(nodes, local, [{"zero": l.zero(), "gas": gas} for l, gas in cases])
        for (layout, gas), per_rank_stats in zip(cases, results):
            row: dict[str, Any] = {"nodes": nodes, "local": local, "gas": gas, "layout": asdict(layout),
                                   "config": comm_measure.base_config(layout.zero(), gas)}
            errors = [r["error"] for r in per_rank_stats if "error" in r]
            if errors:
                row["error"] = errors[0]
            else:
                row["kinds"], row["spread"] = comm_measure.mean_and_spread(per_rank_stats)
            rows.append(row)
    return {"parameters": comm_measure.PARAMETERS, "element_bytes": comm_measure.ELEMENT_BYTES,
            "two_stage_reduce": True,  # gloo: [Note: two-stage reduce-scatter on gloo]
            "steps": comm_measure.STEPS, "model": f"{comm_measure.DEPTH} x Linear({comm_measure.WIDTH}, "
            f"{comm_measure.WIDTH}, bias=False), bf16, gloo on CPU", "rows": rows}


def main(argv: list[str] | None = None) -> int:
    from bench import comm_model_doc, report

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--measure", action="store_true", help="run the engine on emulated nodes first")
    parser.add_argument("--topologies", default="2x2,2x4,4x2", help="NODESxRANKS,... to measure")
    parser.add_argument("--json", default=str(RESULTS), help="where the JSON goes (and, without --measure, "
                        "where the stored measurement is read from)")
    parser.add_argument("--doc", help="regenerate this doc's `comm:` tables from the JSON")
    parser.add_argument("--check", action="store_true", help="with --doc: exit 1 if its tables are stale")
    args = parser.parse_args(argv)
    if args.doc:
        return comm_model_doc.write_or_check(args.doc, Path(args.json), args.check)
    if args.measure:
        topologies = [tuple(int(x) for x in item.split("x")) for item in args.topologies.split(",")]
        measurement = measure(topologies)  # type: ignore[arg-type]
    else:
        import json

        stored = Path(args.json)
        measurement = json.loads(stored.read_text()).get("measurement") if stored.exists() else None
    report.emit(build(measurement), args.json, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
