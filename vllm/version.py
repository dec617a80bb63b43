"""The package version.

We report the vLLM release whose public API we implement (structured_outputs, the
OpenAI-compatible server, LoRA endpoints), so clients that branch on `/version`
(mellea compares it with 0.12.0) choose the request fields we actually support.
"""

__version__ = "0.12.0"
