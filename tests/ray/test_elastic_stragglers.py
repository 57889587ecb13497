"""A rank persistently slower than the others (its loop, outside the engine) is named as a straggler in the
driver's output, on the progress line and in `Result.stragglers`, while the run goes on unharmed."""
from __future__ import annotations

import pytest
from testkit import elastic_loop

import rayzero


def test_a_rank_slow_in_its_loop_is_reported_as_a_straggler(local_ray, tmp_path, capsys):
    result = rayzero.fit(
        elastic_loop.train, config=elastic_loop.config(), scaling=rayzero.ScalingConfig(num_workers=2),
        run=rayzero.RunConfig(name="straggle", storage=tmp_path.as_uri(), progress_interval_s=0),
        train_loop_config={"steps": 24, "slow_rank": 1, "slow_s": 0.25})
    output = capsys.readouterr().out
    assert [found.rank for found in result.stragglers] == [1], result.stragglers
    found = result.stragglers[0]
    assert found.loop_time_s >= 0.25 and found.loop_time_s >= 1.5 * found.median_loop_time_s
    assert f"straggler: rank 1 (node {found.node_id[:12]}) spends" in output
    assert "| straggler r1" in output  # the progress line once it was found
    assert result.failures == 0
    final = [m for m in result.metrics_history if "final" in m][-1]
    assert final["final"] == pytest.approx(elastic_loop.reference_weights(24), abs=1e-5)
