"""The ``spmd`` placement: one ``jax.shard_map`` program over the ``('data', 'stage')`` mesh that
scans a compiled program's lock-step slots (:mod:`.engine` is its surface: the train step, the
eval step, the state and its shardings)."""
