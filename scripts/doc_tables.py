"""Tables in the docs that are generated from bench/results/*.json, so a cited figure cannot drift
from its raw result. `make docs-check` runs `--check`; `--write` regenerates them.

A generated table sits between two markers in its document:

    <!-- generated: recovery (bench/results/recovery.json); edit the JSON's renderer, not this table -->
    ...
    <!-- end generated: recovery -->

    python scripts/doc_tables.py --write     # regenerate every table in place
    python scripts/doc_tables.py --check     # exit 1 naming each table that differs
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

FAULTS = (("kill", "worker SIGKILL"), ("hang", "hang (one rank sleeps)"), ("sigterm", "worker SIGTERM (preemption)"),
          ("node", "node removed (Cluster, spare node)"), ("resize", "planned resize 2 -> 1"))


def _spread(figure: dict[str, float] | None, unit: str = " s", digits: int = 1) -> str:
    if not figure:
        return "-"
    text = f"{figure['median']:.{digits}f}{unit}"
    if figure["min"] != figure["max"]:
        text += f" ({figure['min']:.{digits}f}-{figure['max']:.{digits}f})"
    return text


def _lost(figure: dict[str, float] | None) -> str:
    if not figure:
        return "-"
    median = f"{figure['median']:g}"
    median = f"**{median}**" if figure["median"] == 0 else median
    return median if figure["min"] == figure["max"] else f"{median} ({figure['min']:g}-{figure['max']:g})"


def recovery_table(result: dict[str, Any]) -> str:
    summary = {(row["system"], row["kind"]): row for row in result["summary"]}
    rounds = max((row.get("rounds", 1) for row in result["summary"] if row["system"] == "rayzero"), default=1)
    lines = [f"`{result['command']}`; median (min-max) over up to {rounds} rounds; {result['machine']}.", "",
             "| fault | rayzero: detected | rayzero: first step after | steps lost | Ray Train v2: first step after "
             "| steps lost |",
             "|---|---|---|---|---|---|"]
    for kind, label in FAULTS:
        ours, theirs = summary.get(("rayzero", kind), {}), summary.get(("ray-train-v2", kind))
        if theirs is None:
            their_step, their_lost = "n/a", "-"
        elif theirs.get("no_recovery"):
            their_step, their_lost = theirs["no_recovery"], "-"
        else:
            their_step, their_lost = _spread(theirs.get("first_step_s")), _lost(theirs.get("steps_lost"))
        lines.append(f"| {label} | {_spread(ours.get('detect_s'), digits=2)} | {_spread(ours.get('first_step_s'))} | "
                     f"{_lost(ours.get('steps_lost'))} | {their_step} | {their_lost} |")
    return "\n".join(lines)


def memory_table(result: dict[str, Any]) -> str:
    meta = result["meta"]
    versus = {(c["system"], c["world_size"]): c for c in result["comparisons"] if "reference" in c}
    heading = (f"`{result['command']}`, started {meta['started']}: {meta['model']} "
               f"({meta['trainable_parameters'] / 1e6:.1f}M parameters), {meta['steps']} steps of "
               f"{meta['batch_per_rank']} x {meta['tokens_per_sequence']} tokens per rank, {meta['rounds']} round(s); "
               f"{meta['machine']}.")
    columns = ("| system | ranks | peak growth, B/param: median (min-max) | tensors alive, B/param | peak / FSDP2's "
               "| loss gap to FSDP2 | estimate's error |")
    lines = [heading, "", columns, "|---|---|---|---|---|---|---|"]
    for row in sorted(result["results"], key=lambda r: (r["world_size"], r["system"])):
        if "peak_bytes_per_param" not in row:
            lines.append(f"| {row['system']} | {row['world_size']} | failed: {row.get('errors', ['?'])[0][:60]} "
                         "| | | | |")
            continue
        compared = versus.get((row["system"], row["world_size"]), {})
        ratio, gap, error = compared.get("peak_ratio"), compared.get("loss_max_abs_gap"), row.get("estimate_error")
        lines.append(f"| {row['system']} | {row['world_size']} | {_spread(row['peak_bytes_per_param'], '', 2)} | "
                     f"{row['census_resident_bytes_per_param']['total']:.2f} | "
                     f"{'-' if ratio is None else _spread(ratio, '', 3)} | {'-' if gap is None else f'{gap:.1e}'} | "
                     f"{'-' if error is None else f'{error:+.1%}'} |")
    return "\n".join(lines)


def _slope(figures: dict[str, Any] | None, name: str, unit: str = "") -> str:
    figure = (figures or {}).get(name)
    if not figure or figure.get("per_100k_steps") is None:
        return "-"
    value = figure["per_100k_steps"]
    return f"{value:+,.0f}{unit}" if name == "python_blocks" else f"{value:+.2f}{unit}"


def _memory_rows(label: str, memory: dict[str, Any] | None) -> str:
    """One row of a long run's memory table: the slopes past the warm-up, per 100,000 steps."""
    if not memory:
        return f"| {label} | none: one relay's worth of ranks, gathered in the controller |" + " |" * 7
    steady, whole = memory["steady"], memory["whole_run"]
    rss = steady.get("rss") or {}
    return (f"| {label} | {rss.get('first', 0):.0f} -> {rss.get('last', 0):.0f} | **{_slope(steady, 'rss')}** | "
            f"{_slope(whole, 'rss')} | {_slope(steady, 'rss_anon')} | {_slope(steady, 'rss_shmem')} | "
            f"{_slope(steady, 'heap_in_use')} / {_slope(steady, 'heap_free')} | {_slope(steady, 'pymalloc_arenas')} | "
            f"{_slope(steady, 'python_blocks')} |")


_MEMORY_HEADER = ("| process | RSS after the warm-up -> at the end (MiB) | RSS, MiB per 100k steps | the same over the whole "
                  "run | anonymous | object-store pages | malloc in use / free | Python's arenas | Python's live "
                  "blocks |\n|---|---|---|---|---|---|---|---|---|")


def longrun_table(result: dict[str, Any]) -> str:
    """bench/longrun.py real or relay: per process, what its memory did past the warm-up."""
    if result["kind"] == "relay":
        head = (f"`bench/longrun.py relay`: a `NodeRelay` actor over {result['ranks']} simulated ranks, "
                f"{result['rate']:g} steps a second each, {result['steps']:,} steps ({result['reports']:,} reports) in "
                f"{result['wall_s']:.0f} s, a collect a second")
        rows = [_memory_rows("relay actor", result["memory"]["relay"])]
    else:
        loop = (f"the report loop ({result['rate']:g} steps a second)" if result.get("loop") == "report"
                else "the training loop (an MLP at ZeRO stage 1)")
        head = (f"`bench/longrun.py real`: {result['workers']} workers, {loop}, {result['steps']:,} steps in "
                f"{result['wall_s']:.0f} s ({result['steps_per_s_first_5pct']:.0f} / {result['steps_per_s_last_5pct']:.0f} "
                f"steps/s over the first / last 5 %), {result['metrics_parts']} metrics parts")
        rows = [_memory_rows(name, result["memory"].get(name)) for name in ("driver", "controller", "relays")]
        workers = result["memory"]["workers"]
        rows.append(f"| largest worker | {workers['steady']['rss']['first']:.0f} -> {workers['steady']['rss']['last']:.0f} "
                    f"| {_slope(workers['steady'], 'rss')} | {_slope(workers['whole_run'], 'rss')} |" + " |" * 5)
    return (f"{head}; the warm-up is the first {result['warm_up_steps']:,} steps; 1-minute load average at the end "
            f"{result['load_average_end']:.0f}. Per 100,000 steps past the warm-up (least squares):\n\n"
            + _MEMORY_HEADER + "\n" + "\n".join(rows))


def longrun_sim_table(result: dict[str, Any]) -> str:
    """bench/longrun.py simulate: the driver's metrics path, memory past the first 10 % of the rows."""
    rows = [_memory_rows(f"driver, {run['rows']:,} rows from {run['ranks']:,} ranks ({run['rows'] // run['ranks']:,} steps)",
                         run["driver_memory"]) for run in result["runs"]]
    return ("`bench/longrun.py simulate`: the driver's per-report path fed as fast as it goes, its memory measured "
            "after each of 50 flushes; the warm-up is the first 10 % of the rows (at least 20,000). Per 100,000 "
            "steps (rows / ranks) past it:\n\n" + _MEMORY_HEADER + "\n" + "\n".join(rows))


def longrun_speed_table(result: dict[str, Any]) -> str:
    """bench/longrun.py simulate: a flush's time against what was written before, reports a second."""
    before = result["before"][0]
    rows_before = " / ".join(f"{item['rows'] // 1000}k" for item in before)
    times_before = " / ".join(f"{item['flush_s']:.2f}" for item in before)
    most = max(run["rows"] for run in result["runs"])
    largest = [run for run in result["runs"] if run["rows"] == most]
    flushes = "; ".join(f"{run['flush_s_median']:.2f} s median ({run['ranks']:,} ranks, max {run['flush_s_max']:.1f} s, "
                        f"slope {run['flush_s_slope_per_million_rows']:+.3f} s per million rows)" for run in largest)
    rates = "; ".join(f"{run['reports_per_s_first_10pct'] / 1e3:.1f}k / {run['reports_per_s_last_10pct'] / 1e3:.1f}k "
                      f"({run['ranks']:,} ranks)" for run in largest)
    dropped = sum(run["rows_dropped"] for run in result["runs"])
    return ("| | before (the flush of issue 25, timed in the same run) | after |\n|---|---|---|\n"
            f"| one flush at {rows_before} rows written | {times_before} s | the write of a part of only the new rows, "
            f"whatever was written before, up to {most:,} rows: {flushes} |\n"
            f"| reports a second through the driver, first / last 10 % ({most:,} rows) | slowing with every flush "
            f"| {rates} |\n"
            f"| rows dropped | | {dropped} |")


# table name -> (the document it sits in, its JSON, the renderer)
TABLES: dict[str, tuple[str, str, Callable[[dict[str, Any]], str]]] = {
    "recovery": ("docs/controller.md", "bench/results/recovery.json", recovery_table),
    "memory": ("bench/README.md", "bench/results/memory.json", memory_table),
    "memory-llama": ("bench/README.md", "bench/results/memory-llama.json", memory_table),
    "longrun-train": ("bench/README.md", "bench/results/longrun-real.json", longrun_table),
    "longrun-report": ("bench/README.md", "bench/results/longrun-report.json", longrun_table),
    "longrun-relay": ("bench/README.md", "bench/results/longrun-relay.json", longrun_table),
    "longrun-sim": ("bench/README.md", "bench/results/longrun-sim.json", longrun_sim_table),
    "longrun-before": ("bench/README.md", "bench/results/longrun-report-before.json", longrun_table),
    "longrun-speed": ("bench/README.md", "bench/results/longrun-sim.json", longrun_speed_table),
}


def _block(name: str, source: str, body: str) -> str:
    return (f"<!-- generated: {name} ({source}); edit the JSON's renderer in scripts/doc_tables.py, not this "
            f"table -->\n{body}\n<!-- end generated: {name} -->")


def render(document: str, text: str) -> str:
    for name, (doc, source, renderer) in TABLES.items():
        if doc != document:
            continue
        pattern = re.compile(rf"<!-- generated: {re.escape(name)} .*?<!-- end generated: {re.escape(name)} -->", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{document} has no generated block named {name!r}: add the two markers")
        body = renderer(json.loads((ROOT / source).read_text()))
        text = pattern.sub(lambda _: _block(name, source, body), text)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true")
    mode.add_argument("--check", action="store_true")
    args = parser.parse_args(argv)
    stale = []
    for document in sorted({doc for doc, _, _ in TABLES.values()}):
        path = ROOT / document
        current = path.read_text()
        wanted = render(document, current)
        if wanted != current:
            if args.write:
                path.write_text(wanted)
                print(f"wrote {document}")
            else:
                stale.append(document)
    if not stale:
        return 0
    print("\n".join(f"{document}: a generated table differs from its JSON; run "
                    "`python scripts/doc_tables.py --write`" for document in stale), file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
