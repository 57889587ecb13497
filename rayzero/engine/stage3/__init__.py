"""ZeRO stage 3: parameters, gradients, fp32 masters and optimizer state all partitioned.

    strategy.py     Stage3Strategy, the stage's `ZeroStrategy`
    parameters.py   each parameter keeps only its shard; gathered on demand   [Note: stage-3 parameter storage]
    hooks.py        gather before use, release after, prefetch                [Note: modules every rank runs]
    trace.py        the recorded fetch order prefetch replays (pure logic)    [Note: stage-3 prefetch order]
    gradients.py    reduce-scatter of full gradients in buckets during backward
    stall.py        a stalled collective checked for ranks in different modules
    zero_init.py    `rayzero.zero.Init`: build a model already partitioned (zero_init_hf.py: HF models)
    gathered.py     `rayzero.zero.GatheredParameters`: full parameters for a block

Imports the offload backends (engine/offload), never the reverse (import-linter).
"""
