"""Checkpoint format, partition math, topology and data position: pure logic, one process."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors import safe_open

from rayzero.checkpoint.comm import Topology
from rayzero.checkpoint.data_position import ResumableSampler
from rayzero.checkpoint.direct_io import aligned_empty
from rayzero.checkpoint.manifest import (
    FileEntry,
    Manifest,
    Piece,
    TensorEntry,
    commit,
    committed_tags,
    read_latest,
    read_manifest,
    set_latest,
)
from rayzero.checkpoint.reshard import build_tensor_entries, choose_writers, files_for, plan_read
from rayzero.checkpoint.retention import apply_retention, claim_tag_dir
from rayzero.checkpoint.shard_file import CorruptShardError, LoadedShardFile, file_checksum, write_shard_file
from rayzero.checkpoint.types import ShardSpec


def test_shard_file_is_standard_safetensors_and_checksummed(tmp_path):
    aligned = aligned_empty((3 << 18) + 5, torch.float32)  # > 1 MiB, page-aligned: written with no copy
    aligned.copy_(torch.randn(aligned.numel()))
    tensors = {"module/a": torch.randn(7).to(torch.bfloat16), "optim/step/a": torch.arange(3),
               "master/a": torch.randn(5), "module/flag": torch.tensor([True, False, True]),
               "master/big": aligned, "module/big": torch.randn((1 << 19) + 3).to(torch.bfloat16)}
    path = str(tmp_path / "rank00000.safetensors")
    written = write_shard_file(path, list(tensors.items()))
    assert written.size == os.path.getsize(path) and written.checksum == file_checksum(path)
    with safe_open(path, framework="pt") as handle:  # the reference reader agrees
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor)
    loaded = LoadedShardFile.read(path, written.checksum)
    for name, tensor in tensors.items():
        assert torch.equal(loaded.tensor(name), tensor)
    with open(path, "r+b") as handle:
        handle.seek(-3, os.SEEK_END)
        handle.write(b"\x00\x01\x02")
    with pytest.raises(CorruptShardError):
        LoadedShardFile.read(path, written.checksum)


def _specs(world: int, numel: int = 10, name: str = "master/w") -> list[list[ShardSpec]]:
    chunk = -(-numel // world)
    return [[ShardSpec(name, (numel,), torch.float32, min(r * chunk, numel), min((r + 1) * chunk, numel)),
             ShardSpec("module/w", (2, numel // 2), torch.float32, 0, numel)] for r in range(world)]


def test_replicated_ranges_written_once_partitioned_by_each_rank():
    specs = _specs(3)
    writers = choose_writers(specs)
    assert writers == [{"master/w", "module/w"}, {"master/w"}, {"master/w"}]
    entries = build_tensor_entries(specs, writers)
    assert entries["module/w"].pieces == (Piece("rank00000.safetensors", 0, 10),)
    assert [(p.start, p.end) for p in entries["master/w"].pieces] == [(0, 4), (4, 8), (8, 10)]
    # a range spanning pieces of two files: one step per piece, targets contiguous
    steps = plan_read("master/w", entries["master/w"], 3, 9)
    assert [(s.piece.file, s.source_start, s.source_end, s.target_start) for s in steps] == [
        ("rank00000.safetensors", 3, 4, 0), ("rank00001.safetensors", 0, 4, 1), ("rank00002.safetensors", 0, 1, 5)]
    assert files_for(entries, [ShardSpec("master/w", (10,), torch.float32, 5, 7)]) == {"rank00001.safetensors"}


def test_hole_or_disagreement_is_refused():
    specs = _specs(3)
    del specs[1][0]  # rank 1 lost its master piece: elements 4..8 are nowhere
    with pytest.raises(ValueError, match="no data for elements"):
        build_tensor_entries(specs, choose_writers(specs))
    specs = _specs(2)
    specs[1][1] = ShardSpec("module/w", (5, 2), torch.float32, 0, 10)
    with pytest.raises(ValueError, match="same global tensor"):
        build_tensor_entries(specs, choose_writers(specs))


def _manifest(tag: str, step: int) -> Manifest:
    return Manifest(tag=tag, step=step, world_size=1, stage=0, config_digest="x",
                    files={"rank00000.safetensors": FileEntry(8, "0", 0, "node0")},
                    tensors={"module/w": TensorEntry((2,), "float32", (Piece("rank00000.safetensors", 0, 2),))},
                    rank_states=[])


def test_only_committed_tags_exist_and_retention_keeps_newest(tmp_path):
    root = str(tmp_path)
    for step in (1, 2, 3):
        claim_tag_dir(os.path.join(root, f"global_step{step}"), "lineage-a")
        commit(os.path.join(root, f"global_step{step}"), _manifest(f"global_step{step}", step))
        set_latest(root, f"global_step{step}")
    partial = os.path.join(root, "global_step4")
    claim_tag_dir(partial, "lineage-a")
    open(os.path.join(partial, "rank00000.safetensors.tmp"), "wb").close()  # a save that died
    assert [tag for _, tag in committed_tags(root)] == ["global_step3", "global_step2", "global_step1"]
    assert read_latest(root) == "global_step3"
    assert read_manifest(os.path.join(root, "global_step3")).tensors["module/w"].shape == (2,)
    deleted = apply_retention(root, keep_last=2, lineage="lineage-a")
    assert sorted(deleted) == ["global_step1", "global_step4"]
    assert sorted(os.listdir(root)) == ["global_step2", "global_step3", "latest"]


def test_replicas_go_to_other_nodes_spread_by_local_rank():
    topology = Topology.from_nodes(["a", "a", "b", "b", "c", "c"], node_local=True)
    assert [topology.replica_targets(rank, 1) for rank in range(6)] == [[2], [3], [4], [5], [0], [1]]
    assert topology.replica_targets(0, 5) == [2, 4]  # capped at the other nodes
    for rank in range(6):  # never on the rank's own node
        assert all(topology.locations[t] != topology.locations[rank] for t in topology.replica_targets(rank, 2))
    assert Topology.from_nodes(["a", "b"], node_local=False).replica_targets(0, 1) == []
    assert Topology.from_nodes(["a", "b", "b"], node_local=True).replica_targets(2, 1) == [0]


def test_data_position_gives_same_global_batches_at_any_world_size():
    size, global_batch = 50, 12

    def global_batches(world: int, consumed: int, steps: int) -> list[list[int]]:
        samplers = [ResumableSampler(size, global_batch, rank, world, seed=3) for rank in range(world)]
        for sampler in samplers:
            sampler.set_position(consumed)
        streams = [list(sampler) for sampler in samplers]
        per_rank = global_batch // world
        return [sorted(i for stream in streams for i in stream[step * per_rank:(step + 1) * per_rank])
                for step in range(steps)]

    uninterrupted = global_batches(2, 0, 4)
    assert global_batches(3, 2 * global_batch, 2) == uninterrupted[2:4]
    assert global_batches(4, 1 * global_batch, 3) == uninterrupted[1:4]
    # 50 samples hold 4 global batches; position 48 is the start of epoch 1, in a new order
    sampler = ResumableSampler(size, global_batch, 0, 1, seed=3)
    sampler.set_position(4 * global_batch)
    assert sampler.epoch == 1 and sampler.offset == 0 and len(sampler) == 48
    with pytest.raises(ValueError, match="multiple of the world"):
        ResumableSampler(size, 10, 0, 3)


def test_scatter_plan_streams_what_it_can_and_reads_the_rest_whole():
    from rayzero.checkpoint.loader import _scatter_plan

    a = TensorEntry((8,), "float32", (Piece("f1", 0, 4), Piece("f2", 4, 8)))
    b = TensorEntry((4,), "bfloat16", (Piece("f1", 0, 4),))
    c = TensorEntry((4,), "float32", (Piece("f3", 0, 4),))
    manifest = Manifest(tag="t", step=1, world_size=2, stage=1, config_digest="", files={},
                        tensors={"a": a, "b": b, "c": c}, rank_states=[])
    needed = [ShardSpec("a", (8,), torch.float32, 2, 6), ShardSpec("b", (4,), torch.float32, 0, 4),
              ShardSpec("c", (4,), torch.float32, 0, 4)]
    destinations = {"a": torch.empty(4), "b": torch.empty(4), "c": torch.empty(4)}
    scatters, filled = _scatter_plan(manifest, needed, destinations)
    # b needs a bf16 -> fp32 conversion: f1 is read whole, so a (f1 + f2) is served from memory too
    assert filled == {"c"} and set(scatters) == {"f3"}
    assert [(name, start, end) for name, start, end, _ in scatters["f3"]] == [("c", 0, 4)]
    scatters, filled = _scatter_plan(manifest, needed[:1] + needed[2:], destinations)
    assert filled == {"a", "c"}
    assert [(name, start, end) for name, start, end, _ in scatters["f2"]] == [("a", 0, 2)]
