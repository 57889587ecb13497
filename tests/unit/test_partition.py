"""Partition math ([Note: bucket partitioning]) without a process group."""
from __future__ import annotations

import pytest

from rayzero.engine.partition import BucketLayout, ParamSlot, padded_size, plan_buckets, split_evenly


def test_buckets_close_before_overflowing_and_big_params_stand_alone():
    layout = plan_buckets([3, 4, 10, 2, 0, 1], bucket_size=8, world_size=2)
    assert [[s.index for s in b.slots] for b in layout.buckets] == [[0, 1], [2], [3, 5]]
    assert [b.numel for b in layout.buckets] == [7, 10, 3]
    assert [b.padded_numel for b in layout.buckets] == [8, 10, 4]
    assert layout.numel == 20 and layout.padded_numel == 22


@pytest.mark.parametrize("world", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("numels", [[5], [1, 1, 1], [13, 7, 2, 9], [100, 3]])
def test_every_element_owned_exactly_once_and_padding_never_owned(world, numels):
    layout = plan_buckets(numels, bucket_size=16, world_size=world)
    owned = {i: [0] * n for i, n in enumerate(numels)}
    for bucket in layout.buckets:
        assert bucket.padded_numel % world == 0 and bucket.padded_numel - bucket.numel < world
        shard_total = 0
        for rank in range(world):
            for slot in bucket.slots:
                piece = bucket.piece(slot, rank)
                assert 0 <= piece.param_start <= piece.param_end <= slot.numel
                start, _ = bucket.shard_range(rank)
                # the piece sits where the flat buffer says it does
                assert start + piece.shard_offset == slot.offset + piece.param_start or piece.numel == 0
                for e in range(piece.param_start, piece.param_end):
                    owned[slot.index][e] += 1
                shard_total += piece.numel
        assert shard_total == bucket.numel
    assert all(count == 1 for counts in owned.values() for count in counts)


def test_group_shard_offsets_concatenate_bucket_slices():
    layout = plan_buckets([6, 6, 5], bucket_size=6, world_size=4)
    assert [b.shard_numel for b in layout.buckets] == [2, 2, 2]
    assert layout.shard_offsets == (0, 2, 4) and layout.shard_numel == 6


def test_param_spanning_two_ranks_is_split_at_the_shard_boundary():
    bucket = BucketLayout((ParamSlot(0, 3, 0), ParamSlot(1, 4, 3)), world_size=2)
    assert bucket.padded_numel == 8 and bucket.shard_range(1) == (4, 8)
    assert bucket.piece(bucket.slots[1], 0) == bucket.piece(bucket.slots[1], 0).__class__(0, 1, 3)
    piece = bucket.piece(bucket.slots[1], 1)
    assert (piece.param_start, piece.param_end, piece.shard_offset) == (1, 4, 0)
    assert bucket.piece(bucket.slots[0], 1).numel == 0


def test_bad_arguments_name_the_setting():
    with pytest.raises(ValueError, match="reduce_bucket_size"):
        plan_buckets([1], bucket_size=0, world_size=1)
    with pytest.raises(ValueError, match="world_size"):
        padded_size(3, 0)


def test_split_evenly_matches_padded_shards():
    assert [split_evenly(10, 3, r) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert [split_evenly(2, 4, r) for r in range(4)] == [(0, 1), (1, 2), (2, 2), (2, 2)]
