"""`RequestLogger`: one log line per submitted request (`--enable-log-requests`).

Invariant: a prompt is shown up to `max_log_len` characters and token ids (all of it
when None), so logs stay bounded for long conversations; nothing is logged unless the
flag is given (prompts may be private).
"""

from __future__ import annotations

from typing import Optional

from vllm.inputs import TokensPrompt
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)


class RequestLogger:
    def __init__(self, max_log_len: Optional[int] = None):
        self.max_log_len = max_log_len

    def log_inputs(self, request_id: str, prompt: TokensPrompt, params: SamplingParams,
                   lora_request: Optional[LoRARequest]) -> None:
        text = prompt.get("prompt")
        ids = prompt.get("prompt_token_ids")
        if self.max_log_len is not None:
            text = text[: self.max_log_len] if text is not None else None
            ids = ids[: self.max_log_len] if ids is not None else None
        logger.info("Received request %s: prompt: %r, params: %s, prompt_token_ids: %s, lora_request: %s",
                    request_id, text, params, ids, lora_request)
