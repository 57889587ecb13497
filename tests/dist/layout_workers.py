"""What the ranks of tests/dist/test_stage3_layouts.py run: stage 3 on emulated nodes.

`nodes_init` gives each rank a node before forming the gloo group (GROUP_RANK, as torchrun and rayzero's
workers set it: [Note: topology] in rayzero/engine/topology.py), RANKS_PER_NODE ranks per node, and
installs the independent traffic count (tests/testkit/traffic_probe.py) before rayzero is imported."""
from __future__ import annotations

import os
from typing import Any

from testkit import harness as H
from testkit import traffic_probe

RANKS_PER_NODE = 2


def node_of(rank: int) -> int:
    return rank // RANKS_PER_NODE


def nodes_init(rank: int, world_size: int) -> None:
    os.environ["GROUP_RANK"] = str(node_of(rank))
    traffic_probe.install(node_of)
    H.gloo_init(rank, world_size)


def _link_totals(stats: dict[str, dict[str, int]]) -> tuple[int, int]:
    """The engine's bytes per link class over every kind of the step (control included)."""
    kinds = [v for k, v in stats.items() if k != "total"]
    return sum(v["intra_node_bytes"] for v in kinds), sum(v["inter_node_bytes"] for v in kinds)


def traffic(engine: Any) -> dict[str, Any]:
    """After `train_case`'s steps: one more step, counted by the engine and by the probe."""
    case = _CASE
    traffic_probe.reset()
    H.train_steps(engine, engine.comm.rank, engine.comm.world_size, case, case.steps, case.steps + 1)
    probe = (traffic_probe.COUNTS["intra_node_bytes"], traffic_probe.COUNTS["inter_node_bytes"])
    return {"engine_links": _link_totals(engine.comm_stats()), "probe_links": probe,
            "comm": engine.comm_stats()}


_CASE: H.Case | None = None


def run(rank: int, world: int, cases: list[H.Case]) -> list[Any]:
    global _CASE
    out = []
    for case in cases:
        _CASE = case
        try:
            out.append(H.train_case(rank, world, case, probe=traffic))
        except Exception as error:  # noqa: BLE001 - a refused layout is a result the test checks
            out.append(f"{type(error).__name__}: {error}")
    return out


def checkpoint_leg(rank: int, world: int, leg: dict) -> H.CaseResult:
    """Steps [first, last) of `leg["case"]`, resuming from `leg["load"]` if given, saving to `leg["save"]`:
    one leg of a run that changes layout and world size at each checkpoint."""
    case = leg["case"]
    engine, _ = H.start_engine(rank, case)
    if leg.get("load"):
        engine.load_checkpoint(leg["load"])
    loaded = H.master_pieces(engine)
    losses = H.train_steps(engine, rank, world, case, leg["first"], leg["last"])
    engine.save_checkpoint(leg["save"], asynchronous=False)
    result = H.CaseResult(case, losses, H.master_pieces(engine), extra={"loaded": loaded})
    engine.close()
    return result
