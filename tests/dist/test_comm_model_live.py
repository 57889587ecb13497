"""bench/comm_model.py's byte formulas against a fresh measurement: the real engine on 4 gloo ranks as 2
emulated nodes x 2 (bench/comm_measure.py), flat, hpZ and MiCS. The stored measurement
(tests/unit/test_comm_model.py) shows the formulas held when it was taken; this shows they still hold
for the engine as it is now, so docs/scale.md section 3 goes stale loudly when the engine's traffic
changes. The quantized layout is compared with what the engine reports doing (int8 gathers / the int4
all-to-all once they are in, the unquantized formula before)."""
from __future__ import annotations

import pytest

from bench import comm_measure
from bench import comm_model as M

LAYOUTS = [M.Layout("flat"), M.Layout("hpz", 2), M.Layout("mics", 2), M.Layout("zeropp", 2)]
QWZ_BLOCK, QGZ_BLOCK, _ = M.elements_per_scale(comm_measure.WIDTH)
QUANTIZED = (1 + 4 / QWZ_BLOCK, 0.5 + 4 / QGZ_BLOCK)


def test_formulas_equal_a_fresh_measurement_on_two_nodes_of_two():
    results = comm_measure.run_topology(2, 2, [{"zero": layout.zero(), "gas": 1} for layout in LAYOUTS])
    for layout, per_rank_stats in zip(LAYOUTS, results):
        assert all("error" not in stats for stats in per_rank_stats), per_rank_stats[0]
        kinds, spread = comm_measure.mean_and_spread(per_rank_stats)
        assert all(max(v.values(), default=0) == 0 for v in spread.values()), (layout.label, spread)
        did = M.engine_quantizes(kinds, comm_measure.ELEMENT_BYTES)
        formula = M.per_rank(M.collectives(layout, 2, 2, comm_measure.ELEMENT_BYTES, QUANTIZED, quantize=did,
                                               two_stage_reduce=True))  # gloo across nodes
        for kind in set(formula) | set(kinds):
            for link in M.LINKS:
                want = formula.get(kind, {}).get(link, 0.0) * comm_measure.PARAMETERS
                got = kinds.get(kind, {}).get(link, 0)
                if any(did):  # quantized pieces carry block padding the per-element formula averages over
                    assert got == pytest.approx(want, rel=0.01), (layout.label, kind, link)
                else:
                    assert got == want, (layout.label, kind, link, got, want)
