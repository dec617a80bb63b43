"""`Processor`: validates and tokenises a request before it reaches the engine core.

Everything a user can get wrong is caught here, as a ValueError naming the field
and what is allowed, so bad input never reaches the engine loop. It is also the one
place that searches prompt tokens for an aLoRA's invocation sequence: the request's
`alora_invocation_start` is the first token of the invocation's *last* occurrence in
the prompt; no occurrence is an error (PEFT would silently run the base model).
"""

from __future__ import annotations

from typing import Optional, Sequence

from vllm import fault_injection
from vllm.config import VllmConfig
from vllm.core.kv_cache_utils import make_block_hasher
from vllm.core.request import Request
from vllm.inputs import PromptType, lone_surrogate
from vllm.lora.request import LoRARequest
from vllm.sampling_params import SamplingParams


def find_last_occurrence(tokens: Sequence[int], pattern: Sequence[int]) -> Optional[int]:
    """Start index of the last occurrence of `pattern` in `tokens`, or None."""
    n = len(pattern)
    if n == 0 or n > len(tokens):
        return None
    first = pattern[0]
    for start in range(len(tokens) - n, -1, -1):
        if tokens[start] == first and list(tokens[start : start + n]) == list(pattern):
            return start
    return None


class Processor:
    def __init__(self, vllm_config: VllmConfig, tokenizer, eos_token_ids: set[int], lora_adapters=None,
                 structured_output_manager=None):
        self.config = vllm_config
        self.model_config = vllm_config.model_config
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self.lora_adapters = lora_adapters
        self.structured_output_manager = structured_output_manager
        caching = vllm_config.cache_config.enable_prefix_caching
        self._block_hasher = make_block_hasher(vllm_config.cache_config.block_size) if caching else None

    def tokenize_prompt(self, prompt: PromptType) -> tuple[Optional[str], list[int], Optional[str]]:
        """Returns (prompt text or None, prompt token ids, cache salt)."""
        # The prompt's text even when ids come with it: the server tokenises before it gets here.
        fault_injection.on_tokenize(prompt.get("prompt") if isinstance(prompt, dict) else prompt)
        if isinstance(prompt, str):
            return prompt, self._encode(prompt), None
        if isinstance(prompt, dict):
            salt = prompt.get("cache_salt")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not all(isinstance(t, int) for t in ids):
                    raise ValueError("prompt_token_ids must be a list of integers.")
                return prompt.get("prompt"), list(ids), salt
            if "prompt" in prompt and isinstance(prompt["prompt"], str):
                return prompt["prompt"], self._encode(prompt["prompt"]), salt
        raise ValueError(
            f"Unsupported prompt {type(prompt).__name__}: expected a string, {{'prompt': str}} or "
            "{'prompt_token_ids': list[int]}."
        )

    def _encode(self, text: str) -> list[int]:
        problem = lone_surrogate(text)  # the tokenizer would fail on it with a TypeError
        if problem is not None:
            raise ValueError(f"The prompt holds invalid text: {problem}; prompts must be valid Unicode (UTF-8).")
        return self.tokenizer.encode(text)

    def make_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        arrival_time: Optional[float] = None,
        lora_request: Optional[LoRARequest] = None,
        cache_salt: Optional[str] = None,
        priority: int = 0,
    ) -> Request:
        """Validate one (child) request and build its engine-side `Request`."""
        self._validate_prompt(prompt_token_ids)
        self._check_priority(priority)
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}.")
        params.verify_against_vocab(self.model_config.vocab_size)
        self._check_logprobs(params)
        alora_start, lora_weights = self._resolve_lora(lora_request, prompt_token_ids)
        grammar = None
        if params.structured_outputs is not None:
            if self.structured_output_manager is None:
                raise ValueError("Structured outputs are not available in this engine.")
            self.structured_output_manager.validate(params.structured_outputs)
            grammar = self.structured_output_manager.grammar_for(params.structured_outputs)
        params.update_from_tokenizer(self.tokenizer.eos_token_id, self.eos_token_ids)
        params.update_bad_words(lambda text: self.tokenizer.encode(text, add_special_tokens=False))
        max_model_len = self.model_config.max_model_len
        max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - len(prompt_token_ids)
        return Request(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            max_tokens=max(max_tokens, 1),
            arrival_time=arrival_time,
            lora_request=lora_request,
            alora_invocation_start=alora_start,
            lora_weights=lora_weights,
            cache_salt=cache_salt,
            block_hasher=self._block_hasher,
            grammar=grammar,
            priority=priority,
        )

    def _check_priority(self, priority: int) -> None:
        if not isinstance(priority, int) or isinstance(priority, bool):
            raise ValueError(f"priority must be an integer, got {priority!r}.")
        if priority != 0 and self.config.scheduler_config.policy != "priority":
            raise ValueError(f"Got priority {priority} but priority scheduling is not enabled: start the engine with "
                             "scheduling_policy='priority' (--scheduling-policy priority).")

    def _check_logprobs(self, params: SamplingParams) -> None:
        limit = self.model_config.max_logprobs
        for name, value in (("sample logprobs", params.logprobs), ("prompt logprobs", params.prompt_logprobs)):
            if value is not None and value > limit:
                raise ValueError(f"Requested {name} of {value}, which is greater than max allowed: {limit} "
                                 "(raise --max-logprobs).")

    def _validate_prompt(self, prompt_token_ids: list[int]) -> None:
        if not prompt_token_ids:
            raise ValueError("The decoder prompt cannot be empty.")
        max_model_len = self.model_config.max_model_len
        if len(prompt_token_ids) > max_model_len:
            raise ValueError(
                f"The decoder prompt (length {len(prompt_token_ids)}) is longer than the maximum model length "
                f"of {max_model_len}. Make sure that `max_model_len` is no smaller than the number of text tokens."
            )
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"Prompt token ids must be in [0, {vocab}); got {bad[:5]}.")

    def _refuse_control_tokens(self, lora_request: LoRARequest, prompt_token_ids: list[int]) -> None:
        """A runtime adapter and an embedded one (Granite Switch control token) cannot both
        govern a request: its tokens would be computed with one and cached as the other."""
        switch = getattr(self.model_config.hf_config, "switch", None)
        if switch is None:
            return
        controls = switch.control_to_adapter()
        found = sorted({t for t in prompt_token_ids if t in controls})
        if found:
            names = self.tokenizer.convert_ids_to_tokens(found)
            raise ValueError(
                f"The prompt holds Granite Switch control tokens {names} but also names the runtime adapter "
                f"{lora_request.lora_name!r}; use one or the other (control tokens select the checkpoint's "
                "embedded adapters)."
            )

    def _resolve_lora(self, lora_request: Optional[LoRARequest], prompt_token_ids: list[int]):
        """(alora_invocation_start, the adapter's host weights) of a request's adapter."""
        if lora_request is None:
            return None, None
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request must be a LoRARequest, got {type(lora_request).__name__}.")
        if self.lora_adapters is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} was requested but LoRA is not enabled; "
                "start the engine with enable_lora=True (--enable-lora)."
            )
        adapter = self.lora_adapters.get(lora_request)
        self._refuse_control_tokens(lora_request, prompt_token_ids)
        invocation = adapter.invocation_tokens
        if not invocation:
            return None, adapter
        start = find_last_occurrence(prompt_token_ids, invocation)
        if start is None:
            text = self.tokenizer.decode(invocation, skip_special_tokens=False)
            raise ValueError(
                f"aLoRA adapter {lora_request.lora_name!r} requires its invocation sequence {text!r} "
                f"(token ids {list(invocation)}) in the prompt, but the prompt does not contain it. "
                "Append the invocation string to the prompt (for chat, it is usually added by the chat template "
                "or a final turn)."
            )
        return start, adapter
