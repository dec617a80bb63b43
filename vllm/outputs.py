"""What `LLM.generate` returns and what the server turns into JSON (vLLM's field names)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

from vllm.lora.request import LoRARequest


@dataclass
class Logprob:
    """Log-probability of one token. `rank` is 1 for the most likely token."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# One dict per generated token: token id -> Logprob (the sampled token and the top-N).
SampleLogprobs = list[dict[int, Logprob]]
# One entry per prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[Optional[dict[int, Logprob]]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: Optional[float]
    logprobs: Optional[SampleLogprobs]
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | None while running
    stop_reason: Union[int, str, None] = None  # the stop string or stop token that ended it
    lora_request: Optional[LoRARequest] = None
    # Decoded text of each generated token such that "".join(token_texts) == text
    # (multi-byte characters are attributed to the token that completes them).
    token_texts: list[str] = field(default_factory=list, repr=False)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: Optional[float] = None
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    finished_time: Optional[float] = None

    @property
    def time_to_first_token(self) -> Optional[float]:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    prompt_logprobs: Optional[PromptLogprobs]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: Optional[RequestMetrics] = None
    lora_request: Optional[LoRARequest] = None
    num_cached_tokens: int = 0

    def __repr__(self) -> str:
        return (
            f"RequestOutput(request_id={self.request_id!r}, prompt={self.prompt!r}, "
            f"prompt_token_ids={self.prompt_token_ids}, outputs={self.outputs}, finished={self.finished}, "
            f"num_cached_tokens={self.num_cached_tokens}, lora_request={self.lora_request})"
        )
