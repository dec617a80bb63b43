"""Tensor parallelism: the process group of the ranks (parallel_state.py) and the worker
processes the engine starts for ranks 1..N-1 (vllm/executor/multiproc.py)."""
