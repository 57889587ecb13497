"""`RunStatus` snapshots of a live controller ([Note: the control seam] in status.py).

[Note: status at scale]
A status names every rank, so building one is O(ranks) (10 ms and ~8,000 objects at 4,096 ranks,
and the allocations bring on the garbage collector's pauses: GetStatus p99 went to 190 ms under
load). The rank table only changes when a heartbeat round does, so it is built once per round
(`RankTable`), with each rank's heartbeat age as of that round, and the gRPC service converts a
given table to protobuf once (`ControlServicer`). A status call then costs O(1) between rounds.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING

from rayzero.controller import throughput
from rayzero.controller.status import RankStatus, RunStatus

if TYPE_CHECKING:
    from rayzero.controller.controller import Controller


class RankTable:
    """The per-rank part of a status, rebuilt only after a new heartbeat round ([Note: status at scale])."""

    def __init__(self) -> None:
        self._key: tuple[int, int, int] | None = None  # (heartbeat round, attempt, world size) it was built at
        self._ranks: tuple[RankStatus, ...] = ()

    def ranks(self, controller: Controller) -> tuple[RankStatus, ...]:
        key = (controller.heartbeat_rounds, controller.attempt, controller.world_size)
        if key != self._key:
            ranks = rank_statuses(controller)
            self._key, self._ranks = key, ranks  # one assignment each: gRPC threads read it concurrently
        return self._ranks


def rank_statuses(controller: Controller) -> tuple[RankStatus, ...]:
    """Every rank of the current group as its newest heartbeat described it, ages as of now."""
    beats = dict(controller.heartbeats)  # a copy: the step thread updates it (dict() copies atomically)
    now, heard_at = controller.clock(), dict(controller.heard_at)
    # the age is how long ago the rank last answered: a stopped or wedged rank's grows, while a rank
    # blocked in a collective waiting for it still answers (its progress age is the hang detector's)
    return tuple(
        RankStatus(rank=rank, node_id=beat.node_id, heartbeat_age_s=max(0.0, now - heard_at.get(rank, now)),
                   step=beat.step,
                   micro_step=beat.micro_step, memory_bytes=beat.memory_bytes,
                   host_memory_bytes=beat.host_memory_bytes)
        for rank, beat in sorted(beats.items()) if beat is not None and rank < controller.world_size)


def run_status(controller: Controller, run_name: str, started_at: float, table: RankTable | None = None) -> RunStatus:
    """A snapshot of `controller` now; reads only what its step loop already recorded (no worker call).
    With `table`, the ranks are those of the newest heartbeat round ([Note: status at scale])."""
    report = controller.last_rank0_report
    goodput = controller.goodput.snapshot(time.time())  # [Note: goodput accounting]
    metrics = report.metrics if report is not None else {}
    step = metrics.get("step")
    if not isinstance(step, (int, float)):
        beat = controller.heartbeats.get(0)
        step = beat.step if beat is not None else 0
    loss = metrics.get("loss")
    ranks = table.ranks(controller) if table is not None else rank_statuses(controller)
    latest = controller.latest_checkpoint
    plan = controller.plan
    measured = throughput.rates(controller.first_rank0_report, report, plan.train_batch_size)
    budget = controller.policy_budget
    return RunStatus(
        run_name=run_name,
        state=controller.state.value,
        attempt=controller.attempt,
        world_size=controller.world_size,
        min_workers=plan.min_workers,
        max_workers=plan.max_workers,
        started_at=started_at,
        step=int(step),
        loss=float(loss) if isinstance(loss, (int, float)) else None,
        samples_per_s=_number(measured.get("samples_per_s", metrics.get("samples_per_s"))),
        tokens_per_s=_number(measured.get("tokens_per_s", metrics.get("tokens_per_s"))),
        last_report_time=report.time if report is not None else 0.0,
        checkpoints=(latest,) if latest is not None else (),
        failures=controller.failures,
        max_failures=budget,
        ranks=ranks,
        message=controller.message,
        extra={**({"stopped": str(controller.stopped).lower()} if controller.state.is_terminal else {}),
               **controller.interval.describe(controller.nodes(), controller.failures, float(goodput.get("wall_s") or 0)),
               **layout_extra(controller.layout, controller.attempt), **link_extra(report)},
        goodput=goodput.get("goodput"),
        wall_s=float(goodput.get("wall_s") or 0.0),
        badput_s=dict(goodput.get("badput_s") or {}),
    )


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) else None


def layout_extra(layout: tuple[int, dict] | None, attempt: int) -> dict[str, str]:
    """`layout` / `groups`: the nodes and rank 0's groups of the current attempt's engine (its
    `engine.layout()`), as `rayzero status` prints them; nothing before its first report."""
    if layout is None or layout[0] != attempt:
        return {}
    described = layout[1]
    groups = [f"{name} {_ranks(described[key])}" for key, name in
              (("shard_group", "shard"), ("replica_group", "replicas (MiCS)"), ("hpz_group", "hpZ secondary"))
              if described.get(key)]
    quantized = [name for key, name in (("quantized_weights", "weights (qwZ)"),
                                        ("quantized_gradients", "gradients (qgZ)")) if described.get(key)]
    out = {"layout": str(described.get("nodes", "?")), "groups": "rank 0: " + "; ".join(groups)}
    if quantized:
        out["groups"] += "; int8/int4 " + " and ".join(quantized)
    return out


def link_extra(report: object) -> dict[str, str]:
    """`link bytes`: what rank 0's engine sent in its last step inside its node and to other nodes
    ([Note: bytes per link class]); metrics.parquet has every rank's."""
    intra, inter = getattr(report, "intra_node_bytes", None), getattr(report, "inter_node_bytes", None)
    if intra is None or inter is None:
        return {}
    return {"link bytes": f"rank 0, last step: {_amount(intra)} inside its node, {_amount(inter)} to other nodes"}


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}"
    return ",".join(map(str, ranks))


def _amount(count: int) -> str:
    """Decimal units, as network rates are read: 0 B, 512 B, 12.3 kB, 4.56 MB, 7.89 GB."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if count >= size:
            return f"{count / size:.3g} {unit}" if count < 100 * size else f"{count / size:.0f} {unit}"
    return f"{count} B"
