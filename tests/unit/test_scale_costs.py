"""The control path's costs grow at most linearly with the ranks (issue 24, section 4; bench/scale.py).

Each test counts the work deterministically (items a function looks at, manifests parsed, bytes
written) at two sizes, or at one size against a linear bound; each failed on the code before its fix.
"""
from __future__ import annotations

import gc
import json
import os
import pickle
import threading
from types import SimpleNamespace

import pytest

from rayzero.checkpoint.comm import Topology, gather_cost
from rayzero.checkpoint.manifest import FileEntry, Manifest, Piece, TensorEntry, commit
from rayzero.checkpoint.reshard import plan_read
from rayzero.controller import committed_checkpoints
from rayzero.controller.committed_checkpoints import CheckpointTracker
from rayzero.controller.health import HangPolicy, find_hang, stacks_text
from rayzero.workers.boundary import Heartbeat

pytestmark = pytest.mark.unit


class CountingTuple(tuple):
    """A tuple that counts the items anyone iterated over."""

    def __new__(cls, items):
        made = super().__new__(cls, items)
        made.looked_at = 0
        return made

    def __iter__(self):
        for item in super().__iter__():
            self.looked_at += 1
            yield item


def _pieces_looked_at(ranks: int) -> int:
    pieces = CountingTuple(Piece(f"rank{rank:05d}.safetensors", rank * 4, rank * 4 + 4) for rank in range(ranks))
    steps = plan_read("w", TensorEntry((ranks * 4,), "float32", pieces), 0, ranks * 4)
    assert [step.piece.start for step in steps] == list(range(0, ranks * 4, 4))  # every piece, in order
    return pieces.looked_at


def test_planning_a_read_of_a_tensor_split_over_n_ranks_looks_at_each_piece_a_bounded_number_of_times():
    # was a scan over every piece per step: 64 -> 256 pieces cost 16x (minutes per tensor at 4,096 ranks)
    small, large = _pieces_looked_at(64), _pieces_looked_at(256)
    assert large <= 4.5 * small, (small, large)


def test_a_tensor_with_a_hole_is_still_refused():
    entry = TensorEntry((12,), "float32", (Piece("a", 0, 4), Piece("b", 8, 12)))
    with pytest.raises(ValueError, match=r"no data for elements \[4, 12\)"):
        plan_read("w", entry, 0, 12)
    overlapping = TensorEntry((12,), "float32", (Piece("a", 0, 6), Piece("b", 2, 12), Piece("c", 4, 8)))
    assert [(s.piece.file, s.source_start, s.source_end) for s in plan_read("w", overlapping, 1, 12)] == [
        ("a", 1, 6), ("b", 4, 10)]  # at each position the piece reaching furthest


def _locations_looked_at(ranks: int) -> int:
    locations = CountingTuple(f"node{rank // 8}" for rank in range(ranks))
    topology = Topology(locations)
    targets = [topology.replica_targets(rank, 1) for rank in range(ranks)]  # what every save plans
    assert targets[0] == [8] and targets[-1] == [7]  # the next node, same local index, cyclically
    return locations.looked_at


def test_planning_every_ranks_replicas_looks_at_the_topology_a_bounded_number_of_times():
    # was three scans of every rank's location per rank: O(ranks^2) per rank and save (~1 s at 4,096)
    small, large = _locations_looked_at(64), _locations_looked_at(256)
    assert large <= 4.5 * small, (small, large)


def _manifest(ranks: int) -> Manifest:
    rng_state = {"torch": "AAAA", "python": [3, list(range(625)), None]}
    return Manifest(tag="global_step7", step=7, world_size=ranks, stage=3, config_digest="d",
                    files={f"rank{r:05d}.safetensors": FileEntry(1024, "c" * 32, r, f"node{r // 8}")
                           for r in range(ranks)},
                    tensors={"master/w": TensorEntry((ranks * 4,), "float32",
                                                     tuple(Piece(f"rank{r:05d}.safetensors", r * 4, r * 4 + 4)
                                                           for r in range(ranks)))},
                    rank_states=[{"rank": r, "node": f"node{r // 8}", "rng": rng_state} for r in range(ranks)])


def test_a_manifest_is_written_compact_and_reads_back_the_same():
    manifest = _manifest(16)
    text = manifest.to_json()
    # indentation put every RNG integer on its own line: twice the bytes, and json's pure-Python
    # encoder (its C encoder runs only without indent): tens of seconds per commit at 4,096 ranks
    assert "\n" not in text and ": " not in text
    assert Manifest.from_json(text) == manifest
    assert json.loads(text)["step"] == 7


def test_a_second_listing_parses_no_manifest_again(tmp_path, monkeypatch):
    for step in (100, 200):
        tag = tmp_path / f"global_step{step}"
        tag.mkdir()
        manifest = _manifest(4)
        manifest.step, manifest.tag = step, tag.name
        commit(str(tag), manifest)
    parsed = []
    real = committed_checkpoints._read_manifest
    monkeypatch.setattr(committed_checkpoints, "_read_manifest", lambda *args: parsed.append(args) or real(*args))
    tracker = CheckpointTracker((str(tmp_path),), node_local=False)
    assert tracker.refresh().step == 200
    assert len(parsed) == 2
    # a failure lists again twice (the newest, then where to resume): each manifest was parsed already
    assert tracker.refresh().step == 200 and tracker.resume_location() == str(tmp_path)
    assert len(parsed) == 2
    # a new checkpoint is parsed once; a deleted one is forgotten
    manifest = _manifest(4)
    manifest.step, manifest.tag = 300, "global_step300"
    os.makedirs(tmp_path / "global_step300")
    commit(str(tmp_path / "global_step300"), manifest)
    os.remove(tmp_path / "global_step100" / "manifest.json")
    assert tracker.refresh().step == 300 and len(parsed) == 3
    assert [found.record.step for found in committed_checkpoints.committed_in(str(tmp_path), tracker.manifests)] == [300, 200]
    assert len(parsed) == 3


def test_a_manifest_is_parsed_without_the_garbage_collector_walking_it(tmp_path):
    """[Note: registry scans]: collections set off by the parse's own containers walk every object made
    so far, so a parse grew faster than the manifest (N^1.2 at 4,096 ranks in bench/scale.py)."""
    tag = tmp_path / "global_step7"
    tag.mkdir()
    commit(str(tag), _manifest(512))  # thousands of containers: collections without the pause
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    filesystem, root = committed_checkpoints._filesystem(str(tag))
    gc.collect()
    gc.callbacks.append(count)
    try:
        summary = committed_checkpoints._read_manifest(filesystem, f"{root}/manifest.json")
    finally:
        gc.callbacks.remove(count)
    assert summary is not None and summary[0] == 7
    assert collections == [] and gc.isenabled()


def _hang_report(ranks: int) -> str:
    beats = {rank: Heartbeat(rank, f"node{rank // 8}", 10, 10, 0.5, True, False, 1.0, 0, 0, None, False,
                             in_step=True) for rank in range(ranks)}
    beats[3] = Heartbeat(3, "node0", 9, 9, 70.0, True, False, 1.0, 0, 0, None, False)
    hang = find_hang(beats, dict.fromkeys(beats, 0.5), HangPolicy())
    assert hang is not None and hang.culprit == 3
    # the others wait in the same collective: the same stack but for their thread idents
    stacks = {rank: f'Thread "MainThread" ({140000000000 + rank}):\n  File "train.py", line 9, in loop\n'
              for rank in range(ranks)}
    stacks[3] = 'Thread "MainThread" (1):\n  File "data.py", line 5, in next_batch\n'
    return hang.reason + "\n\n" + stacks_text(stacks, hang.culprit)


def test_a_hang_report_grows_with_the_distinct_situations_not_with_the_ranks():
    small, large = _hang_report(64), _hang_report(1024)
    assert len(large) <= len(small) + 40, (len(small), len(large))  # was one line and one dump per rank
    assert large.index("--- rank 3 Python stacks (culprit) ---") < large.index("--- ranks 0-2, 4-1023 (1023 ranks")
    assert "seconds without progress per rank: 3: 70; 0-2, 4-1023: 0" in large
    assert large.count("File \"train.py\"") == 1


class _BeatingGroup:
    """Always running; every heartbeat round every rank answers at step `self.step`."""

    def __init__(self, ranks: int) -> None:
        self.ranks, self.step = ranks, 1

    def start(self):
        return {}

    def launch(self, train_loop, loop_config):
        pass

    def poll(self, timeout_s):
        from rayzero.controller.worker_group import GroupPoll

        return GroupPoll()

    def heartbeats(self, timeout_s):
        return {rank: Heartbeat(rank, f"node{rank // 8}", self.step, self.step, 0.1, True, False, 1.0, 0, 0, None,
                                False) for rank in range(self.ranks)}, []

    def shutdown(self, until_free=False):
        pass


def test_status_calls_between_heartbeat_rounds_reuse_the_rank_table(monkeypatch):
    from rayzero.controller import control_server
    from rayzero.controller.controller import Controller
    from rayzero.controller.elastic import BatchPlan
    from rayzero.controller.failures import FailurePolicy
    from rayzero.controller.states import RunState
    from rayzero.controller.status_view import RankTable, run_status

    group = _BeatingGroup(64)
    now = [1000.0]
    controller = Controller(lambda attempt, resume, workers: group, lambda: None, None, FailurePolicy(0),
                            plan=BatchPlan(64, 64, None), clock=lambda: now[0])
    while controller.state is not RunState.RUNNING:
        controller.step()
    controller.step()  # the first heartbeat round
    table = RankTable()

    class Target:
        def status(self):
            return run_status(controller, "run", 0.0, table)

    converted = []
    real = control_server.rank_messages
    monkeypatch.setattr(control_server, "rank_messages", lambda status: converted.append(1) or real(status))
    servicer = control_server.ControlServicer(Target())
    first, again = servicer._message(Target().status()), servicer._message(Target().status())
    assert len(first.ranks) == len(again.ranks) == 64 and first.ranks[63].step == 1
    assert len(converted) == 1  # was a rank table built and converted per call: O(ranks) each
    group.step, now[0] = 2, now[0] + 1.5
    controller.step()  # a new round: the table follows it
    fresh = servicer._message(Target().status())
    assert len(converted) == 2 and fresh.ranks[63].step == 2


def _collections_in_a_commit(ranks: int, directory) -> int:
    """Collections started while the tensor table of `ranks` ranks is built and its manifest written."""
    import torch

    from rayzero.checkpoint.reshard import build_tensor_entries
    from rayzero.checkpoint.types import ShardSpec

    specs = [[ShardSpec(f"layer{layer}.weight", (ranks * 4,), torch.float32, rank * 4, rank * 4 + 4)
              for layer in range(16)] for rank in range(ranks)]
    writers = [{spec.name for spec in rank_specs} for rank_specs in specs]
    manifest = _manifest(ranks)
    collections = []

    def count(phase, info):
        if phase == "start":
            collections.append(info["generation"])

    gc.collect()
    gc.callbacks.append(count)
    try:
        tensors = build_tensor_entries(specs, writers)
        commit(str(directory), manifest)
    finally:
        gc.callbacks.remove(count)
    assert len(tensors) == 16 and gc.isenabled()
    return len(collections)


def test_a_commit_builds_and_writes_the_manifest_without_the_garbage_collector_walking_it(tmp_path):
    """The commit's side of [Note: registry scans] (rayzero/checkpoint/collector.py): the tensor table
    of N ranks' specs and the manifest's serialization set off collections in proportion to N, each
    walking everything made so far (the commit's CPU N^1.1 at 4,096 ranks in bench/scale.py). Paused,
    what was made is walked once when the collector resumes, however many ranks there are."""
    small = _collections_in_a_commit(64, tmp_path)
    large = _collections_in_a_commit(1024, tmp_path)
    assert small <= 2 and large <= 2, (small, large)  # 1 and 44 before the pause


class _ThreadedWorld:
    """`ranks` threads standing in for a checkpoint group: each all-gather returns every rank's
    value; the pickled size of each rank's value is recorded per call (what the gather moves)."""

    def __init__(self, ranks: int) -> None:
        self.world_size = ranks
        self.slots: list = [None] * ranks
        self.barrier = threading.Barrier(ranks)
        self.calls: list[list[int]] = []  # per all-gather: each rank's pickled size

    def comm(self, rank: int) -> SimpleNamespace:
        def all_gather_object(value):
            self.slots[rank] = value
            self.barrier.wait()
            gathered = list(self.slots)
            if rank == 0:
                self.calls.append([len(pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)) for item in gathered])
            self.barrier.wait()
            return gathered

        return SimpleNamespace(rank=rank, world_size=self.world_size, all_gather_object=all_gather_object)


def _load_exchange(tmp_path, ranks: int, node_local: bool, monkeypatch) -> tuple[int, int, set[str]]:
    """(stat calls, bytes each rank receives, files found) of a load's inventory over three committed
    checkpoints: shared storage holding every file, or one rank per node holding its own file and its
    left neighbour's replica."""
    from rayzero.checkpoint import loader

    names = [f"rank{rank:05d}.safetensors" for rank in range(ranks)]
    roots = [tmp_path / f"{'node' if node_local else 'shared'}{ranks}" / (f"n{rank}" if node_local else "")
             for rank in range(ranks)]
    for rank, root in enumerate(roots if node_local else roots[:1]):
        kept = {names[rank], names[rank - 1]} if node_local else set(names)
        for step in (5, 6, 7):  # keep_last 3
            tag = root / f"global_step{step}"
            tag.mkdir(parents=True)
            for name in kept:
                (tag / name).write_bytes(b"x" * 64)
            commit(str(tag), Manifest(tag=tag.name, step=step, world_size=ranks, stage=3, config_digest="d",
                                      files={name: FileEntry(64, "c" * 32, index, f"node{index}")
                                             for index, name in enumerate(names)}, tensors={}, rank_states=[]))
    looked = []
    real = os.path.isfile
    monkeypatch.setattr(loader.os.path, "isfile", lambda path: looked.append(path) or real(path))
    topology = Topology.from_nodes([f"node{rank}" for rank in range(ranks)], node_local=node_local)
    world = _ThreadedWorld(ranks)
    found: list[set[str]] = []

    def rank_loads(rank: int) -> None:  # what loader.load exchanges before it tries the newest candidate
        comm = world.comm(rank)
        holding: dict[str, set[str]] = {}
        for other, tags in enumerate(loader.gather_tags(comm, topology, str(roots[rank]))):
            for tag in tags:
                holding.setdefault(tag, set()).add(topology.locations[other])
        present, _ = loader.gather_presence(comm, topology, str(roots[rank]), "global_step7", holding["global_step7"])
        if rank == 0:
            found.append(set().union(*present.values()))

    threads = [threading.Thread(target=rank_loads, args=(rank,)) for rank in range(ranks)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    monkeypatch.undo()
    return len(looked), sum(gather_cost(sizes)[1] for sizes in world.calls), found[0]


@pytest.mark.parametrize("node_local", [False, True], ids=["shared storage", "one rank per node"])
def test_a_load_s_inventory_costs_each_rank_bytes_linear_in_the_ranks(tmp_path, monkeypatch, node_local):
    """[Note: one inventory per location]: each location's leader listed every committed checkpoint's
    files, and torch's all-gather padded every rank's share to the largest: on shared storage each
    rank received N copies of an N-file listing (bytes per rank 16x for 4x the ranks). Only the tried
    checkpoint's files are listed now ([Note: gathering uneven objects] in comm.py: 4x)."""
    small_looked, small_bytes, small_found = _load_exchange(tmp_path, 16, node_local, monkeypatch)
    large_looked, large_bytes, large_found = _load_exchange(tmp_path, 64, node_local, monkeypatch)
    assert len(small_found) == 16 and len(large_found) == 64  # every file of the newest one is found
    # one stat per file of the newest checkpoint at its locations (the older two are not listed)
    assert (small_looked, large_looked) == ((32, 128) if node_local else (16, 64))
    assert large_bytes <= 4.5 * small_bytes, (small_bytes, large_bytes)
