"""docs/scale.md section 3's tables, from bench/results/comm_model.json (bench/comm_model.py).

    python bench/comm_model.py --doc docs/scale.md           # rewrite the `comm:` tables
    python bench/comm_model.py --doc docs/scale.md --check   # exit 1 when they differ from the JSON

A table sits between `<!-- comm:NAME -->` and `<!-- /comm:NAME -->`; bench/scale.py's own blocks are
`scale:` ones, so each generator rewrites only its own.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

BLOCK = re.compile(r"(<!-- comm:([\w-]+) -->\n)(.*?)(<!-- /comm:\2 -->)", re.DOTALL)
KIND_SHORT = {"all_gather": "AG", "reduce_scatter": "RS", "all_reduce": "AR", "all_to_all": "A2A"}


def _bytes(value: float) -> str:
    return f"{value:.4g}"


def measured_table(document: dict[str, Any]) -> str:
    """Each measured layout: bytes per parameter per rank per step, per kind, on each link class."""
    measurement = document.get("measurement")
    if not measurement:
        return "_no measurement stored: run `python bench/comm_model.py --measure`_"
    rows: dict[tuple, dict[str, Any]] = {}
    for point in document["points"]:
        key = (point["nodes"], point["local"], point["layout"], point["gas"])
        row = rows.setdefault(key, {"cells": [], "off": []})
        if point["measured"] or point["formula"]:
            link = "intra" if point["link"] == "intra_node_bytes" else "inter"
            row["cells"].append(f"{KIND_SHORT[point['kind']]} {link} {_bytes(point['measured'])}")
            if abs(point["measured"] - point["formula"]) > 1e-6 * max(1.0, point["formula"]):
                row["off"].append(f"{KIND_SHORT[point['kind']]} {link}: formula {_bytes(point['formula'])}")
    out = ["| nodes x ranks | layout | GAS | measured bytes per parameter per rank (bf16) | against the formula |",
           "|---|---|---|---|---|"]
    for (nodes, local, label, gas), row in rows.items():
        verdict = "equal" if not row["off"] else "; ".join(row["off"])
        out.append(f"| {nodes} x {local} | {label} | {gas} | {', '.join(row['cells'])} | {verdict} |")
    for row in measurement["rows"]:
        if "error" in row:
            out.append(f"| {row['nodes']} x {row['local']} | {row['layout']['family']} | {row['gas']} | "
                       f"failed: {row['error'].strip().splitlines()[-1][:120]} | |")
    return "\n".join(out)


def fit_table(document: dict[str, Any]) -> str:
    quantization = document["quantization"]
    lines = ["| layout | kind | link | points | fitted coefficient | largest residual | |", "|---|---|---|---|---|---|---|"]
    for item in document["fit"]:
        coefficient = "—" if item["coefficient"] is None else f"{item['coefficient']:.4f}"
        lines.append(f"| {item['fit_key']} | {item['kind']} | {item['link'].split('_')[0]} | {item['points']} | "
                     f"{coefficient} | {item['max_residual']:.2g} | {'matches' if item['matches_formula'] else 'differs'} |")
    state = []
    for part, key in (("int8 weight gathers (qwZ)", "engine_quantizes_weights"),
                      ("int4 gradient all-to-all (qgZ)", "engine_quantizes_gradients")):
        state.append(f"{part}: {'measured' if quantization[key] else 'not in the engine when measured: analytic'}")
    return "\n".join(lines) + "\n\nQuantized collectives: " + "; ".join(state) + (
        f". Wire bytes per element: qwZ {quantization['qwz_bytes_per_element']:.5f}, qgZ "
        f"{quantization['qgz_bytes_per_element']:.5f} (one fp32 scale per {quantization['qwz_elements_per_scale']} / "
        f"{quantization['qgz_elements_per_scale']} elements: {quantization['source']}).")


def volume_table(document: dict[str, Any]) -> str:
    lines = [("| layout | sent inside the node, per rank | sent to other nodes, per rank | out of each node (ring) | "
             "collectives per micro-batch |"), "|---|---|---|---|---|"]
    for item in document["volumes"]:
        parts = [f"{KIND_SHORT[c['kind']]} {c['what']} ({c['group_nodes']}x{c['group_local']})" for c in item["collectives"]]
        lines.append(f"| {item['layout']} | {item['rank_intra_M']:.3f} M | {item['rank_inter_M']:.3f} M | "
                     f"{item['node_egress_M']:.3f} M | {'; '.join(parts)} |")
    return "\n".join(lines)


def inputs_table(document: dict[str, Any]) -> str:
    a = document["assumptions"]
    models = ", ".join(f"{m['name']}: Ψ = {m['parameters']:.3g}, {m['blocks']} blocks" for m in document["models"])
    rows = [
        ("models", models),
        ("GPUs per node", f"{a['gpus_per_node']}"),
        ("compute per step", (f"6 Ψ x {a['tokens_per_gpu']:,} tokens per GPU (gradient accumulation 1) at "
                             f"{a['peak_tflops']:g} TFLOP/s x MFU {a['mfu']:g} (H100 SXM dense bf16)")),
        ("between nodes", "100 / 400 / 3,200 Gbit/s per node, shared by its GPUs"),
        ("inside a node", f"{a['nvlink_gbytes_per_s']:g} GB/s per GPU and direction (NVLink 4: 900 GB/s both ways)"),
        ("latency per ring step", f"{a['alpha_inter_us']:g} µs across nodes, {a['alpha_intra_us']:g} µs inside"),
        ("calls per step", (f"a gather per block and pass (+2: embedding, head); a gradient collective per "
                           f"{a['bucket_elements']:.0e} elements (DeepSpeed's reduce_bucket_size)")),
        ("overlap", f"{a['overlap']:g}: step = compute + max(0, comm - overlap x compute)"),
        ("dtypes", (f"{a['element_bytes']}-byte gathers and gradients; model states 16 bytes per parameter "
                   f"(bf16 parameter and gradient, fp32 master and two Adam moments), + 2 bytes / K for hpZ's "
                   f"secondary shard; above {a['hbm_gbytes']:g} GB per GPU marked †")),
        ("not modelled", ("quantization kernels' time, activation memory and recomputation, stragglers, "
                         "congestion between concurrent rings, NCCL's tree and PAT algorithms")),
    ]
    return "| input | value |\n|---|---|\n" + "\n".join(f"| {name} | {value} |" for name, value in rows)


def step_table(document: dict[str, Any], model: str) -> str:
    rows = [r for r in document["rows"] if r["model"] == model]
    layouts = list(dict.fromkeys(r["layout"] for r in rows))
    lines = ["| Gbit/s per node | nodes (GPUs) | compute (s) | " + " | ".join(layouts) + " |",
             "|---|---|---|" + "---|" * len(layouts)]
    keys = list(dict.fromkeys((r["node_gbits"], r["nodes"]) for r in rows))
    for gbits, nodes in keys:
        here = {r["layout"]: r for r in rows if r["node_gbits"] == gbits and r["nodes"] == nodes}
        any_row = next(iter(here.values()))
        cells = []
        for layout in layouts:
            row = here.get(layout)
            if row is None:
                cells.append("—")
                continue
            dagger = "" if row["fits"] else " †"
            cells.append(f"{row['step_s']:.3g} s ({row['speedup_vs_flat']:.2f}x){dagger}")
        lines.append(f"| {gbits:,} | {nodes} ({any_row['gpus']:,}) | {any_row['compute_s']:.3g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def sensitivity_table(document: dict[str, Any]) -> str:
    variants = document["sensitivity"]
    layouts = list(variants[0]["step_s"])
    first = variants[0]
    lines = [f"| {first['model']}, {first['nodes']} nodes, {first['node_gbits']} Gbit/s: step (s) | " + " | ".join(layouts)
             + " | best over flat |", "|---|" + "---|" * (len(layouts) + 1)]
    for item in variants:
        steps = item["step_s"]
        best = min(steps, key=steps.get)
        lines.append(f"| {item['variant']} | " + " | ".join(f"{steps[l]:.3g}" for l in layouts)
                     + f" | {best}: {steps['flat'] / steps[best]:.2f}x |")
    return "\n".join(lines)


def published_table(document: dict[str, Any]) -> str:
    lines = ["| paper | published figure | source |", "|---|---|---|"]
    lines += [f"| {p['paper']} | {p['figure']} | {p['source']} |" for p in document["papers"]["published"]]
    sources = [f"- {name}: {where}" for name, where in document["papers"]["sources"].items()]
    return "\n".join(lines) + "\n\nSources:\n" + "\n".join(sources)


def beside_table(document: dict[str, Any]) -> str:
    lines = ["| setting | published | this model |", "|---|---|---|"]
    lines += [f"| {m['setting']} | {m['published']} | {m['model']} |" for m in document["papers"]["model"]]
    return "\n".join(lines)


def tables(document: dict[str, Any]) -> dict[str, str]:
    out = {"measured": measured_table(document), "fit": fit_table(document), "volume": volume_table(document),
           "inputs": inputs_table(document), "sensitivity": sensitivity_table(document),
           "published": published_table(document), "beside": beside_table(document)}
    for model in dict.fromkeys(r["model"] for r in document["rows"]):
        out[f"step-{model}"] = step_table(document, model)
    return out


def render(text: str, document: dict[str, Any]) -> str:
    made = tables(document)

    def fill(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in made:
            raise KeyError(f"docs block comm:{name} has no generator (known: {', '.join(made)})")
        return match.group(1) + made[name] + "\n" + match.group(4)

    return BLOCK.sub(fill, text)


def write_or_check(path: str, results: Path, check: bool) -> int:
    text = Path(path).read_text()
    if not BLOCK.search(text):
        print(f"{path} has no `<!-- comm:NAME -->` block to fill", file=sys.stderr)
        return 1
    fresh = render(text, json.loads(results.read_text()))
    if check:
        if fresh != text:
            print(f"{path} is stale against {results}: run `python bench/comm_model.py --doc {path}`", file=sys.stderr)
            return 1
        print(f"{path} matches {results}")
        return 0
    Path(path).write_text(fresh)
    print(f"wrote {path}")
    return 0
