"""samples/s and tokens/s from rank 0's reports: what the driver's progress line and `rayzero status`
both show, computed one way.

Rates come from the cumulative `samples` / `tokens` a loop reports (over all ranks), else `step`
times the config's `train_batch_size` for samples, between rank 0's first report of the current
attempt and its newest one: a restart's pause and re-run steps are not throughput.
"""
from __future__ import annotations

from rayzero.workers.session import Report


def _number(value: object) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def counts(item: Report, train_batch_size: int | None) -> tuple[float | None, float | None]:
    """(samples, tokens) so far, as `item` says (None where it cannot say)."""
    samples = _number(item.metrics.get("samples"))
    step = _number(item.metrics.get("step"))
    if samples is None and train_batch_size and step is not None:
        samples = step * train_batch_size
    return samples, _number(item.metrics.get("tokens"))


def rates(first: Report | None, last: Report | None, train_batch_size: int | None) -> dict[str, float]:
    """{"samples_per_s", "tokens_per_s"} between two of rank 0's reports (what can be measured)."""
    if first is None or last is None or last.time <= first.time:
        return {}
    elapsed = last.time - first.time
    (first_samples, first_tokens), (last_samples, last_tokens) = counts(first, train_batch_size), counts(
        last, train_batch_size)
    out = {}
    if first_samples is not None and last_samples is not None:
        out["samples_per_s"] = (last_samples - first_samples) / elapsed
    if first_tokens is not None and last_tokens is not None:
        out["tokens_per_s"] = (last_tokens - first_tokens) / elapsed
    return out


def went_back(item: Report, last: Report | None) -> bool:
    """True when rank 0 reports an earlier step than before, or its sequence restarts (new workers)."""
    if last is None:
        return False
    if item.seq <= last.seq:
        return True
    step, last_step = _number(item.metrics.get("step")), _number(last.metrics.get("step"))
    return step is not None and last_step is not None and step < last_step
