"""Request bodies of the OpenAI-compatible API (vLLM's field names) and their
translation into `SamplingParams`.

What it owns: the schema of /v1/completions, /v1/chat/completions and the LoRA adapter
endpoints, and the rules that are about the request alone (not the model): e.g.
`stream_options` needs `stream`, `top_logprobs` needs `logprobs`.

Invariants:
- Every string in a body (keys too) is valid Unicode: a lone surrogate (JSON `\\ud800`)
  is a 400 naming where it is, before anything reaches a tokenizer.
- Unknown top-level fields are accepted and ignored (clients send vendor extras such as
  `documents: []` or `"tools": null`); they are logged at debug level.
- A field of the wrong type or out of range fails validation, which the server answers
  with 400 (never 422 or 500). Range checks shared with the offline API live in
  `SamplingParams`, so both surfaces say the same thing.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Union

from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from vllm.inputs import lone_surrogate
from vllm.logger import init_logger
from vllm.sampling_params import SamplingParams
from vllm.structured_output import structured_outputs_from_request

logger = init_logger(__name__)

# The number of logprobs a request may ask for is checked by the engine (--max-logprobs).
_INT64 = 2**63
_MAX_BIAS = 100.0


def invalid_text(value: Any, where: str = "") -> Optional[str]:
    """Where `value` (a JSON body or any part of it) holds a string that is not valid
    Unicode: JSON's `\\ud800` escapes decode to lone surrogates, which no tokenizer
    can encode. None when every string (dict keys too) is fine."""
    stack = [(where, value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, str):
            problem = lone_surrogate(item)
            if problem is not None:
                return f"{path or 'body'}: invalid text: {problem}; strings must be valid Unicode (UTF-8)."
        elif isinstance(item, dict):
            for key, child in item.items():
                stack.append((path, key))
                stack.append((f"{path}.{key}" if path else str(key), child))
        elif isinstance(item, (list, tuple)):
            stack.extend((f"{path}.{i}" if path else str(i), child) for i, child in enumerate(item))
    return None


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="allow")

    @model_validator(mode="before")
    @classmethod
    def _check_unicode(cls, data: Any) -> Any:
        problem = invalid_text(data)
        if problem is not None:
            raise ValueError(problem)
        return data

    @model_validator(mode="after")
    def _log_ignored_fields(self):
        if self.model_extra:
            logger.debug("Ignoring unknown request fields: %s", sorted(self.model_extra))
        return self


class StreamOptions(OpenAIBaseModel):
    include_usage: Optional[bool] = False
    continuous_usage_stats: Optional[bool] = False


class _SamplingRequest(OpenAIBaseModel):
    """Fields common to completions and chat completions."""

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    seed: Optional[int] = Field(None, ge=-_INT64, lt=_INT64)
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    min_tokens: int = 0
    logit_bias: Optional[dict[str, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: Optional[int] = None
    stream: Optional[bool] = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    # Prefix-cache isolation (vLLM's field): only requests with the same salt share KV blocks.
    cache_salt: Optional[str] = Field(None, min_length=1)
    # Structured outputs: current vLLM, OpenAI, and the legacy vLLM (< 0.12) fields.
    structured_outputs: Optional[dict[str, Any]] = None
    response_format: Optional[dict[str, Any]] = None
    guided_json: Optional[Union[str, dict[str, Any]]] = None
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None
    # Keep only the prompt's last N tokens (-1: the last max_model_len tokens).
    truncate_prompt_tokens: Optional[int] = None
    bad_words: Optional[list[str]] = None
    # The response id is "<prefix>-<request_id>" when the client gives one.
    request_id: Optional[str] = Field(None, min_length=1)
    # Logprob tokens as "token_id:<id>" instead of their text.
    return_tokens_as_token_ids: Optional[bool] = None

    @model_validator(mode="after")
    def _check_common(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("Stream options can only be defined when `stream=True`.")
        if self.prompt_logprobs is not None and self.prompt_logprobs < 0:
            raise ValueError(f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is not available when streaming.")
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1 \
                and self.truncate_prompt_tokens != -1:
            raise ValueError(f"truncate_prompt_tokens must be >= 1 or -1, got {self.truncate_prompt_tokens}.")
        for key in self.logit_bias or {}:
            if not key.strip().lstrip("-").isdigit():
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}.")
        return self

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Usage in every stream chunk (`stream_options.continuous_usage_stats`)."""
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _sampling_params(self, max_tokens: Optional[int], logprobs: Optional[int],
                         prompt_logprobs: Optional[int], defaults: Optional[dict[str, Any]]) -> SamplingParams:
        """Raises ValueError (answered 400) for values SamplingParams rejects. `defaults`
        (the model's generation config) fill the sampling fields the request leaves unset."""
        defaults = defaults or {}

        def unset(name: str, fallback: Any) -> Any:
            value = getattr(self, name)
            return defaults.get(name, fallback) if value is None else value

        structured = structured_outputs_from_request(
            self.structured_outputs, self.response_format, guided_json=self.guided_json,
            guided_regex=self.guided_regex, guided_choice=self.guided_choice, guided_grammar=self.guided_grammar,
        )
        try:
            return SamplingParams(
                n=self.n,
                temperature=unset("temperature", 1.0),
                top_p=unset("top_p", 1.0),
                top_k=unset("top_k", 0),
                min_p=unset("min_p", 0.0),
                presence_penalty=self.presence_penalty or 0.0,
                frequency_penalty=self.frequency_penalty or 0.0,
                repetition_penalty=unset("repetition_penalty", 1.0),
                seed=self.seed,
                stop=self.stop,
                stop_token_ids=self.stop_token_ids,
                ignore_eos=self.ignore_eos,
                max_tokens=max_tokens,
                min_tokens=self.min_tokens,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens,
                spaces_between_special_tokens=self.spaces_between_special_tokens,
                include_stop_str_in_output=self.include_stop_str_in_output,
                logit_bias=_clamped(self.logit_bias),
                allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words,
                structured_outputs=structured,
            )
        except (TypeError, OverflowError) as e:  # a value of a type SamplingParams cannot compare
            raise ValueError(f"Invalid sampling parameters: {e}") from e


def _clamped(logit_bias: Optional[dict[str, float]]) -> Optional[dict[str, float]]:
    """Biases clamped to OpenAI's [-100, 100], as vLLM does (a larger one would overflow the
    logits to inf); non-finite ones are left for SamplingParams to refuse."""
    if logit_bias is None:
        return None
    return {k: min(_MAX_BIAS, max(-_MAX_BIAS, v)) if math.isfinite(v) else v for k, v in logit_bias.items()}


class CompletionRequest(_SamplingRequest):
    prompt: Union[list[int], list[list[int]], str, list[str]]
    max_tokens: Optional[int] = 16
    echo: bool = False
    logprobs: Optional[int] = None
    suffix: Optional[str] = None
    add_special_tokens: bool = True

    @model_validator(mode="after")
    def _check_completion(self):
        if self.suffix is not None:
            raise ValueError("suffix is not currently supported.")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError(f"logprobs must be non-negative, got {self.logprobs}.")
        if isinstance(self.prompt, (str, list)) and len(self.prompt) == 0:
            raise ValueError("prompt must not be empty.")
        if isinstance(self.prompt, list) and any(isinstance(p, list) and not p for p in self.prompt):
            raise ValueError("prompt must not contain an empty token list.")
        return self

    def prompts(self) -> list[Union[str, list[int]]]:
        """The prompt field as a list of prompts (text or token ids)."""
        if isinstance(self.prompt, str):
            return [self.prompt]
        if all(isinstance(p, int) for p in self.prompt):
            return [list(self.prompt)]  # one prompt given as token ids
        return list(self.prompt)

    def to_sampling_params(self, max_tokens: Optional[int], defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        # echo with logprobs also scores the prompt, as vLLM does.
        prompt_logprobs = self.prompt_logprobs
        if self.echo and self.logprobs is not None and prompt_logprobs is None:
            prompt_logprobs = self.logprobs
        return self._sampling_params(max_tokens, self.logprobs, prompt_logprobs, defaults)


class ChatMessageParam(BaseModel):
    """A message with any role (custom roles reach the chat template unchanged)."""

    model_config = ConfigDict(extra="allow")
    role: str
    content: Optional[Union[str, list[Union[str, dict[str, Any]]]]] = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = False
    top_logprobs: Optional[int] = 0
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = True
    documents: Optional[list[dict[str, Any]]] = None
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    # Prepend the last message's content to the answer (with continue_final_message).
    echo: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False

    @model_validator(mode="after")
    def _check_chat(self):
        if self.top_logprobs is not None and self.top_logprobs < 0:
            raise ValueError(f"top_logprobs must be non-negative, got {self.top_logprobs}.")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("when using `top_logprobs`, `logprobs` must be set to true.")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self

    @property
    def requested_max_tokens(self) -> Optional[int]:
        # max_completion_tokens is OpenAI's newer name; it wins, as in vLLM.
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def to_sampling_params(self, max_tokens: Optional[int], defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._sampling_params(max_tokens, logprobs, self.prompt_logprobs, defaults)

    def message_dicts(self) -> list[dict[str, Any]]:
        return [m.model_dump(exclude_none=True) for m in self.messages]

    def template_kwargs(self) -> Optional[dict[str, Any]]:
        """`chat_template_kwargs` plus the fields vLLM hands to the template (`reasoning_effort`)."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}


class LoadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_path: str
    # Replace the weights of an adapter already loaded under this name (vLLM's field).
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(OpenAIBaseModel):
    lora_name: str
    lora_int_id: Optional[int] = None


class TokenizeCompletionRequest(OpenAIBaseModel):
    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: Optional[bool] = False


class TokenizeChatRequest(OpenAIBaseModel):
    model: Optional[str] = None
    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    return_token_strs: Optional[bool] = False
    tools: Optional[list[dict[str, Any]]] = None
    documents: Optional[list[dict[str, Any]]] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _check_chat(self):
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")
        return self


def parse_tokenize_request(body: Any) -> Union[TokenizeCompletionRequest, TokenizeChatRequest]:
    """/tokenize takes either form, told apart by `messages` (as vLLM does). Its errors are
    raised as the routes' schema errors, so they read alike ("prompt: ...", 400)."""
    model = TokenizeChatRequest if isinstance(body, dict) and "messages" in body else TokenizeCompletionRequest
    try:
        return model.model_validate(body)
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None


def _inlined(schema: dict[str, Any]) -> dict[str, Any]:
    """A model's JSON schema with its `$defs` references replaced by the definitions (none
    of these models is recursive), so it can sit anywhere in the OpenAPI document."""
    defs = schema.get("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            if "$ref" in node:
                return resolve(defs[node["$ref"].rsplit("/", 1)[-1]])
            return {k: resolve(v) for k, v in node.items() if k != "$defs"}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    return resolve(schema)


def tokenize_openapi() -> dict[str, Any]:
    """The OpenAPI request body of /tokenize, which reads its JSON by hand (either form)."""
    schema = {"anyOf": [_inlined(TokenizeCompletionRequest.model_json_schema()),
                        _inlined(TokenizeChatRequest.model_json_schema())]}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": schema}}}}


class DetokenizeRequest(OpenAIBaseModel):
    model: Optional[str] = None
    tokens: list[int]
