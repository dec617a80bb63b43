"""The plain data that crosses between scheduler, model runner and engine each step.

`SchedulerOutput` holds only what changed since the last step: requests new to the
runner (first scheduled, or resumed after preemption, with all their tokens), and for
requests the runner already knows, their new blocks. The runner keeps the rest.
`num_computed_tokens` fields are the values *before* this step's tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams


@dataclass
class NewRequestData:
    req_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs exist when resumed)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_request: Optional[LoRARequest]
    alora_invocation_start: Optional[int]
    lora_weights: Any = None  # the adapter weights the request was admitted with (see Request)


@dataclass
class CachedRequestData:
    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class SchedulerOutput:
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]  # req_id -> tokens computed this step
    total_num_scheduled_tokens: int
    finished_req_ids: set[str]  # finished since the last step: the runner drops them
    preempted_req_ids: set[str]  # the runner drops them; they come back as new
    # Blocks handed out fresh this step (never prefix hits): the runner zeroes them.
    new_block_ids: list[int] = field(default_factory=list)
    # Structured outputs: one bitmask row per constrained request that samples.
    grammar_bitmask: Optional[torch.Tensor] = None
    grammar_rows: dict[str, int] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


# One logprobs record per position: token ids (the sampled or actual token first,
# then the top-k), their logprobs, and the rank of the first token.
@dataclass
class LogprobsEntry:
    token_ids: list[int]
    logprobs: list[float]
    rank: int


@dataclass
class ModelRunnerOutput:
    req_ids: list[str]
    # Per request: the sampled tokens ([] for a prefill chunk that does not reach the end).
    sampled_token_ids: list[list[int]]
    logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)
    # Per request: logprobs of the prompt positions computed this step (position p
    # holds the logprobs of token p+1 given tokens 0..p).
    prompt_logprobs: dict[str, list[LogprobsEntry]] = field(default_factory=dict)


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    new_logprobs: Optional[list[LogprobsEntry]] = None
    new_prompt_logprobs: Optional[list[LogprobsEntry]] = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
