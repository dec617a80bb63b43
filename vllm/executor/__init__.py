"""Executors: who runs the model for the engine core. One process (`ModelRunner` itself) or,
with tensor parallelism, `MultiprocExecutor` (rank 0 here, one worker process per other rank)."""
