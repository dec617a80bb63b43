"""vLLM's `vllm.v1` import paths that users' scripts name (`vllm.v1.metrics.reader`)."""
