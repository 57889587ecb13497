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


# table name -> (the document it sits in, its JSON, the renderer)
TABLES: dict[str, tuple[str, str, Callable[[dict[str, Any]], str]]] = {
    "recovery": ("docs/controller.md", "bench/results/recovery.json", recovery_table),
    "memory": ("bench/README.md", "bench/results/memory.json", memory_table),
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
