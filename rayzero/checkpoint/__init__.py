"""rayzero.checkpoint: sharded, atomic checkpoints that reshard online (torch, safetensors, pyarrow; never ray).

Entry points:
  `Checkpointer` (checkpointer.py)      save / load / wait / fence for one training process
  `CheckpointOptions` (options.py)      tiers, replicas, retention, async; from the config's `checkpoint`
  `ShardSpec`, `ShardedTensor` (types.py)  the engine contract ([Note: flat-range partitioning])
  `ResumableSampler` (data_position.py)  a data position valid at any world size
  `wait_for_pending_saves()` (saver.py)  finish every async save of this process (runners, exit paths)
  `rayzero checkpoint ls|verify|consolidate` (cli.py)
Notes: [Note: commit protocol] manifest.py, [Note: checkpoint process group] comm.py,
[Note: choosing what to load] loader.py, [Note: snapshot fence] saver.py, [Note: direct I/O] direct_io.py,
[Note: data position] data_position.py, [Note: async save completion] saver.py,
[Note: checkpoint settings precedence] options.py, [Note: retention owns only its own] retention.py,
[Note: a save that fails on storage] save_failure.py; names: [Note: names that become paths] in
rayzero/config/names.py.
"""
