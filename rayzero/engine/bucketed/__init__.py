"""ZeRO stages 0, 1 and 2: parameters in padded flat bucket buffers, one collective per bucket.

    strategy.py       BucketedStrategy, what the three stages share     [Note: gradient hooks]
    stage0.py         plain data parallelism: all-reduce per bucket
    stage1.py         fp32 masters and optimizer state partitioned
    stage2.py         stage 1 plus gradients reduce-scattered during backward
    state_shards.py   the stages' state as flat ranges for the checkpoint layer, and back

Imports the offload backends (engine/offload), never engine/stage3 (import-linter).
"""
