"""`rayzero status`'s layout, groups and link bytes, from what rank 0's reports carry
(rayzero/controller/status_view.py): the text a user reads for each stage-3 layout."""
from __future__ import annotations

from types import SimpleNamespace

from rayzero.control_api.cli import status_table
from rayzero.controller.control_server import status_message
from rayzero.controller.status import RunStatus
from rayzero.controller.status_view import layout_extra, link_extra

MICS = {"nodes": "2 nodes x 4 ranks", "node_of_rank": [0] * 4 + [1] * 4, "shard_group": [0, 1, 2, 3],
        "replica_group": [0, 4], "hpz_group": None, "quantized_weights": False, "quantized_gradients": False}
ZEROPP = {"nodes": "2 nodes x 2 ranks", "node_of_rank": [0, 0, 1, 1], "shard_group": [0, 1, 2, 3],
          "replica_group": None, "hpz_group": [0, 1], "quantized_weights": True, "quantized_gradients": True}


def test_the_layout_names_the_nodes_and_rank_0s_groups():
    assert layout_extra((3, MICS), 3) == {"layout": "2 nodes x 4 ranks",
                                          "groups": "rank 0: shard 0-3; replicas (MiCS) 0,4"}
    assert layout_extra((1, ZEROPP), 1) == {
        "layout": "2 nodes x 2 ranks",
        "groups": "rank 0: shard 0-3; hpZ secondary 0,1; int8/int4 weights (qwZ) and gradients (qgZ)"}


def test_a_previous_attempts_layout_is_not_shown():
    assert layout_extra((2, MICS), 3) == {}
    assert layout_extra(None, 0) == {}


def test_link_bytes_only_once_an_engine_stepped():
    assert link_extra(SimpleNamespace(intra_node_bytes=None, inter_node_bytes=None)) == {}
    assert link_extra(None) == {}
    assert link_extra(SimpleNamespace(intra_node_bytes=512, inter_node_bytes=12_345)) == {
        "link bytes": "rank 0, last step: 512 B inside its node, 12.3 kB to other nodes"}
    assert link_extra(SimpleNamespace(intra_node_bytes=3_500_000, inter_node_bytes=0)) == {
        "link bytes": "rank 0, last step: 3.5 MB inside its node, 0 B to other nodes"}


def test_the_status_table_prints_them():
    status = RunStatus(run_name="r", state="running", attempt=1, world_size=4, min_workers=4, max_workers=4,
                       started_at=0.0, step=5, extra={**layout_extra((1, ZEROPP), 1), **link_extra(
                           SimpleNamespace(intra_node_bytes=10**6, inter_node_bytes=2 * 10**6))})
    table = status_table(status_message(status)).splitlines()  # as the gRPC client receives it
    assert "layout     2 nodes x 2 ranks" in table
    assert any(line.startswith("groups     rank 0: shard 0-3; hpZ secondary 0,1") for line in table)
    assert "link bytes rank 0, last step: 1 MB inside its node, 2 MB to other nodes" in table
