"""`Request`: the engine-side state of one sequence being generated.

Invariants:
- `all_token_ids == prompt_token_ids + output_token_ids`, and `num_computed_tokens`
  counts how many of them have their KV in the cache (0 after a preemption).
- `block_hashes[i]` is the prefix-cache hash of full block i of `all_token_ids`;
  the list grows as tokens are appended (`block_hasher` decides adapter identity).
- `alora_invocation_start` is None for base requests and plain LoRAs; for an aLoRA
  it is the index of the first token of the last invocation occurrence in the prompt.
- `lora_weights` (the host weights validated at admission) never change: the request
  computes with them to the end, whatever happens to its adapter's name or id meanwhile;
  `adapter_identity` is their fingerprint.
- `priority` (lower runs earlier) matters only under the scheduler's priority policy;
  `sort_key` = (priority, arrival_time) orders requests there.
"""

from __future__ import annotations

import enum
import time
from typing import TYPE_CHECKING, Any, Callable, Optional

from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vllm.structured_output.grammar import RequestGrammar


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything after this is finished.
    FINISHED_STOPPED = 3
    FINISHED_LENGTH_CAPPED = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def is_finished(status: "RequestStatus") -> bool:
        return status >= RequestStatus.FINISHED_STOPPED

    @staticmethod
    def finish_reason(status: "RequestStatus") -> Optional[str]:
        return _FINISH_REASONS.get(status)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    def __init__(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        max_tokens: int,
        arrival_time: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
        alora_invocation_start: Optional[int] = None,
        lora_weights: Any = None,
        cache_salt: Optional[str] = None,
        block_hasher: Optional[Callable[["Request"], list[Any]]] = None,
        grammar: Optional["RequestGrammar"] = None,
        priority: int = 0,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.max_tokens = max_tokens
        self.arrival_time = arrival_time if arrival_time is not None else time.time()
        self.lora_request = lora_request
        # The adapter weights validated at admission (opaque here): the runner loads exactly these,
        # so a request never mixes weights even if its adapter is reloaded from a changed path.
        self.lora_weights = lora_weights
        self.alora_invocation_start = alora_invocation_start
        self.cache_salt = cache_salt
        self.grammar = grammar
        self.priority = priority

        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self._output_token_ids: list[int] = []
        self._all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # set when first scheduled
        self.num_preemptions = 0

        self.block_hashes: list[Any] = []
        self._block_hasher = block_hasher
        if block_hasher is not None:
            self.block_hashes.extend(block_hasher(self))

    @property
    def sort_key(self) -> tuple[int, float]:
        return self.priority, self.arrival_time

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request else 0

    @property
    def adapter_identity(self) -> Any:
        """What the adapter computes with: the fingerprint of the weights the request carries
        (`LoRAModel.fingerprint`), or its `lora_int_id` when it carries none (scheduler tests).
        None for base requests. Prefix-cache keys and slot sharing go by this, not by the id,
        which a caller may reuse for other weights after `remove_lora`."""
        if self.lora_request is None:
            return None
        fingerprint = getattr(self.lora_weights, "fingerprint", b"")
        return fingerprint if fingerprint else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self._all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self._output_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self._output_token_ids

    @property
    def all_token_ids(self) -> list[int]:
        return self._all_token_ids

    @property
    def is_finished(self) -> bool:
        return RequestStatus.is_finished(self.status)

    def append_output_token_id(self, token_id: int) -> None:
        self._output_token_ids.append(token_id)
        self._all_token_ids.append(token_id)
        if self._block_hasher is not None:
            self.block_hashes.extend(self._block_hasher(self))

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, lora={self.lora_int_id})"
        )
