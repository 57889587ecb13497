"""A picture of the run (issue 13 item 4): `rayzero plot` renders a real run's metrics.parquet, with
its restart marked."""
from __future__ import annotations

import pytest
from testkit import crash_loop

import rayzero
from rayzero import plot

pytest.importorskip("matplotlib")


def test_plot_renders_a_real_run_with_its_restart_marked(local_ray, tmp_path, capsys):
    result = rayzero.fit(crash_loop.restarting_loop, scaling=rayzero.ScalingConfig(num_workers=2),
                         train_loop_config={"steps": 6, "crash_after": 4, "resume_at": 3, "sleep": 0.05},
                         run=rayzero.RunConfig(storage=tmp_path.as_uri(), name="pic", progress_interval_s=60),
                         failure=rayzero.FailureConfig(max_failures=1))
    output = tmp_path / "run.png"
    assert plot.main([result.path, "-o", str(output)]) == 0
    assert "1 restart/resize mark(s)" in capsys.readouterr().out
    import matplotlib.image

    pixels = matplotlib.image.imread(str(output))
    assert pixels.shape[0] > 500 and pixels.shape[1] > 500

    picture = plot.plot_run("pic", str(tmp_path / "again.svg"), storage=str(tmp_path))
    assert [(m.step, m.kind) for m in picture.markers] == [(3.0, "restart")]
    assert picture.markers[0].label == "restart 1: loop error"  # the cause, from the run's attempt records
    kinds = [(segment.attempt, segment.kind) for segment in picture.timeline]
    assert (0, "training") in kinds and (1, "training") in kinds  # where the wall time went
    pause = next(segment for segment in picture.timeline if segment.kind == "pause")
    assert pause.attempt == 0 and pause.label == "loop error" and pause.end > pause.start
    steps, losses = picture.series["loss"]["loss"]
    assert steps == [0, 1, 2, 3, 4, 5] and losses == [5.0 - 0.5 * s for s in steps]  # one point per step
    assert picture.series["learning rate"]["lr"][1][-1] == pytest.approx(6e-3)
    assert set(picture.series["peak memory (GiB)"]) == {"rank 0", "rank 1"}
    rate_steps, rates = picture.series["throughput"]["samples/s"]
    assert rate_steps and all(rate > 0 for rate in rates)  # never across the restart's pause or backwards
    assert (tmp_path / "again.svg").read_text().count("<svg") == 1

    assert plot.main([str(tmp_path / "nothing-here")]) == 1
    assert "no metrics log at" in capsys.readouterr().err
