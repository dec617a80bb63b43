"""Metric objects of `LLM.get_metrics()` (see `reader`)."""
