"""bench/comm_model.py: its byte formulas against the engine's measured counts, its fit, its model's
volumes against the ZeRO++ paper's, and docs/scale.md section 3's generated tables.

The oracle of the formulas is the engine's own per-link counts, stored by `comm_model.py --measure` in
bench/results/comm_model.json (tests/dist/test_comm_model_live.py measures a few layouts afresh), which
were themselves checked against an independent wrapper around torch.distributed
(tests/dist/test_stage3_layouts.py)."""
from __future__ import annotations

import copy
import json
import pathlib

import pytest

from bench import comm_measure
from bench import comm_model as M
from bench import comm_model_doc as D

REPOSITORY = pathlib.Path(__file__).resolve().parents[2]
STORED = json.loads(M.RESULTS.read_text())
_QWZ_BLOCK, _QGZ_BLOCK, _ = M.elements_per_scale(comm_measure.WIDTH)
QUANTIZED = (1 + 4 / _QWZ_BLOCK, 0.5 + 4 / _QGZ_BLOCK)  # at the measured model's width


def test_the_stored_measurement_covers_every_layout_on_every_topology_without_errors():
    measurement = STORED["measurement"]
    assert measurement is not None, "run `python bench/comm_model.py --measure`"
    measured = {(r["nodes"], r["local"], M.Layout(**r["layout"]), r["gas"]) for r in measurement["rows"]}
    planned = {(n, l, layout, gas) for (n, l), rows in M.measured_layouts().items() for layout, gas in rows}
    assert measured == planned
    assert not [r for r in measurement["rows"] if "error" in r]
    assert all(max(v.values(), default=0) == 0 for r in measurement["rows"] for v in r["spread"].values()), \
        "every rank of a layout sends the same bytes"


@pytest.mark.parametrize("row", STORED["measurement"]["rows"],
                         ids=lambda r: f"{r['nodes']}x{r['local']}-{M.Layout(**r['layout']).label}-gas{r['gas']}")
def test_formulas_equal_the_engines_counts_byte_for_byte(row):
    """Every kind on every link: Ψ x the formula's bytes per parameter = what each rank counted. What the
    engine did not quantize is compared with the unquantized formula (the model then says `analytic`)."""
    measurement = STORED["measurement"]
    layout = M.Layout(**row["layout"])
    did = M.engine_quantizes(row["kinds"], measurement["element_bytes"])
    formula = M.per_rank(M.collectives(layout, row["nodes"], row["local"], measurement["element_bytes"],
                                       QUANTIZED, quantize=did))
    for kind in set(formula) | set(row["kinds"]):
        for link in M.LINKS:
            per_step = 1 if kind == "all_reduce" else row["gas"]  # MiCS's replicas sync once a step
            want = per_step * formula.get(kind, {}).get(link, 0.0) * measurement["parameters"]
            got = row["kinds"].get(kind, {}).get(link, 0)
            if layout.quantized and any(did):
                assert got == pytest.approx(want, rel=0.01), (kind, link)  # block padding of small shards
            else:
                assert got == want, (kind, link, got, want)


def test_the_stored_fit_matches_the_formulas_and_the_measured_points():
    """The JSON's fit is what `fit` makes of its points, and every non-quantized coefficient is 1."""
    assert M.fit(STORED["points"]) == STORED["fit"]
    assert STORED["fit"] and all(f["matches_formula"] for f in STORED["fit"]), [
        f for f in STORED["fit"] if not f["matches_formula"]]


def test_fit_finds_a_coefficient_and_flags_a_point_off_the_line():
    points = [{"fit_key": "flat", "kind": "all_gather", "link": "inter_node_bytes", "measured": 2.0 * f, "formula": f}
              for f in (1.0, 2.0, 3.0)]
    [line] = M.fit(points)
    assert line["coefficient"] == pytest.approx(2.0) and line["max_residual"] == pytest.approx(0.0)
    assert not line["matches_formula"]
    points = [dict(p, measured=p["formula"]) for p in points]
    points[0]["measured"] = 1.5
    [line] = M.fit(points)
    assert not line["matches_formula"] and line["max_residual"] > M.FIT_TOLERANCE
    [line] = M.fit([dict(p, measured=p["formula"]) for p in points])
    assert line["matches_formula"] and line["coefficient"] == 1.0


def test_flat_zero3_per_rank_bytes_are_the_textbook_count():
    """Each of forward all-gather, backward all-gather and reduce-scatter sends (W-1)/W x Ψ x b per rank,
    of which the share to the W-L ranks on other nodes crosses nodes (hand arithmetic, 4 nodes x 8, bf16)."""
    counted = M.per_rank(M.collectives(M.Layout("flat"), 4, 8, 2, QUANTIZED))
    assert counted["all_gather"] == {"intra_node_bytes": 2 * 2 * 7 / 32, "inter_node_bytes": 2 * 2 * 24 / 32}
    assert counted["reduce_scatter"] == {"intra_node_bytes": 2 * 7 / 32, "inter_node_bytes": 2 * 24 / 32}
    hpz = M.per_rank(M.collectives(M.Layout("hpz", 8), 4, 8, 2, QUANTIZED))
    assert hpz["all_gather"]["inter_node_bytes"] == 2 * 24 / 32, "the backward gather stays in the node"
    mics = M.per_rank(M.collectives(M.Layout("mics", 8), 4, 8, 2, QUANTIZED))
    assert mics["all_gather"]["inter_node_bytes"] == mics["reduce_scatter"]["inter_node_bytes"] == 0
    assert mics["all_reduce"] == {"intra_node_bytes": 0, "inter_node_bytes": 2 * (2 / 8) / 4 * 3}


def test_zeropp_cuts_cross_node_volume_about_4x_as_the_paper_counts():
    """ZeRO++'s blog: 3M -> 0.75M out of each node (M = Ψ x 2 bytes); the ring's egress gives that
    within the scales' and the (g-1)/g terms' few percent."""
    volumes = {v["layout"]: v for v in M.volumes(QUANTIZED, local=8, nodes=128)}
    assert volumes["flat"]["node_egress_M"] == pytest.approx(3.0, rel=0.01)
    assert volumes["hpZ(8)+qwZ+qgZ"]["node_egress_M"] == pytest.approx(0.75, rel=0.03)
    # The engine's point-to-point count per rank: qgZ's second hop sends 1/L of the int4 gradient.
    assert volumes["hpZ(8)+qwZ+qgZ"]["rank_inter_M"] == pytest.approx((QUANTIZED[0] + QUANTIZED[1] / 8) / 2 * 127 / 128)


def test_faster_links_never_make_a_step_slower_and_compute_bounds_it():
    rows = M.grid(M.Assumptions(), QUANTIZED, {})
    for row in rows:
        assert row["step_s"] >= row["compute_s"]
    by_key = {(r["model"], r["nodes"], r["layout"], r["node_gbits"]): r["step_s"] for r in rows}
    for (model, nodes, layout, gbits), step in by_key.items():
        faster = by_key.get((model, nodes, layout, gbits * 4)) or by_key.get((model, nodes, layout, gbits * 8))
        if faster is not None:
            assert faster <= step


def test_the_doc_section_is_generated_from_the_stored_json():
    assert D.write_or_check(str(REPOSITORY / "docs" / "scale.md"), M.RESULTS, check=True) == 0


def test_the_doc_check_fails_on_a_stale_table_and_names_the_fix(tmp_path, capsys):
    doc = tmp_path / "scale.md"
    doc.write_text((REPOSITORY / "docs" / "scale.md").read_text())
    changed = copy.deepcopy(STORED)
    changed["rows"][0]["step_s"] *= 2
    results = tmp_path / "comm_model.json"
    results.write_text(json.dumps(changed))
    assert D.write_or_check(str(doc), results, check=True) == 1
    assert "python bench/comm_model.py --doc" in capsys.readouterr().err
    assert D.write_or_check(str(doc), results, check=False) == 0
    assert D.write_or_check(str(doc), results, check=True) == 0
    doc.write_text("# no generated blocks\n")
    assert D.write_or_check(str(doc), results, check=True) == 1
    doc.write_text("<!-- comm:nonesuch -->\n<!-- /comm:nonesuch -->\n")
    with pytest.raises(KeyError, match="nonesuch"):
        D.write_or_check(str(doc), results, check=True)


def test_the_model_mode_rebuilds_the_stored_json_from_its_measurement():
    """`python bench/comm_model.py` (no --measure) recomputes everything but the measurement: the stored
    JSON is what this code makes of it (else the doc's tables came from older formulas)."""
    rebuilt = json.loads(json.dumps(M.build(STORED["measurement"])))
    if rebuilt["quantization"]["source"] != STORED["quantization"]["source"]:
        pytest.skip("the engine's quantization constants arrived since the JSON was written: rerun the model")
    assert rebuilt == STORED
