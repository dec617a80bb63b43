"""`OpenAIServingCompletion`: POST /v1/completions.

What it owns: turning a completions request (a text prompt, several, token ids, or
several token-id lists) into engine requests, and their outputs into OpenAI's
completions response or its server-sent-event stream, with `echo` and `logprobs=N`.

Invariants:
- Choice `index` is `prompt_index * n + sample_index`, for whole responses and chunks.
- Sampled-token strings in `logprobs.tokens` are the engine's per-token texts, so they
  concatenate to the generated text and `text_offset` indexes into `choices[].text`
  (which starts with the prompt when `echo` is set).
- A stream always ends with `data: [DONE]`; an error after the first byte is sent as a
  `data: {"error": ...}` event, as vLLM does.
"""

from __future__ import annotations

import json
from dataclasses import replace
from contextlib import aclosing
from typing import AsyncIterator, Optional, Sequence, Union

from vllm.engine.async_llm import RequestStream
from vllm.entrypoints.openai.errors import classify, error_body
from vllm.entrypoints.openai.protocol import CompletionRequest
from vllm.entrypoints.openai.response_models import (
    SSE_DONE,
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionResponseStreamChoice,
    CompletionStreamResponse,
    UsageInfo,
    clamp_logprob,
    prompt_logprobs_json,
    sse,
)
from vllm.entrypoints.openai.serving_engine import OpenAIServing
from vllm.inputs import TokensPrompt
from vllm.logger import init_logger
from vllm.outputs import CompletionOutput, Logprob, RequestOutput

logger = init_logger(__name__)

# (token text, that position's logprob dict or None, token id)
_Position = tuple[str, Optional[dict[int, Logprob]], int]


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, request: CompletionRequest) -> Union[CompletionResponse, AsyncIterator[str]]:
        lora_request = self.models.resolve(request.model)
        prompts: list[TokensPrompt] = []
        for prompt in request.prompts():
            text = prompt if isinstance(prompt, str) else None
            ids = self.tokenizer.encode(prompt, add_special_tokens=request.add_special_tokens) if text else list(prompt)
            kept = self.truncate(ids, request.truncate_prompt_tokens)
            if len(kept) < len(ids):
                text = None  # the text no longer matches the ids: echo decodes what was kept
            prompts.append(TokensPrompt(prompt=text, prompt_token_ids=kept) if text else TokensPrompt(
                prompt_token_ids=kept))
        params = [request.to_sampling_params(self.max_tokens_for(len(p["prompt_token_ids"]), request.max_tokens),
                                             self.sampling_defaults)
                  for p in prompts]
        request_id = self.request_id("cmpl", request.request_id)
        streams = await self.submit(request_id, prompts, params, lora_request, request.cache_salt)
        model = self.model_name(request.model)
        if request.stream:
            return self._stream(request, request_id, model, prompts, streams)
        outputs = await self.collect_all(streams)
        return self._response(request, request_id, model, prompts, outputs)

    # ------------------------------------------------------------------ whole response
    def _response(self, request: CompletionRequest, request_id: str, model: str, prompts: list[TokensPrompt],
                  outputs: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for i, output in enumerate(outputs):
            for c in output.outputs:
                text, logprobs = self._echo_prefix(request, prompts[i], output)
                text += c.text
                if request.logprobs is not None:  # generated tokens follow any echoed prompt's
                    logprobs = self._logprobs(request.logprobs, self._positions(c, request.return_tokens_as_token_ids),
                                              len(text) - len(c.text), logprobs)
                choices.append(CompletionResponseChoice(
                    index=i * request.n + c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, prompt_logprobs=prompt_logprobs_json(output.prompt_logprobs),
                ))
        choices.sort(key=lambda choice: choice.index)
        return CompletionResponse(id=request_id, model=model, choices=choices, usage=self.usage(outputs))

    def _echo_prefix(self, request: CompletionRequest, prompt: TokensPrompt,
                     output: RequestOutput) -> tuple[str, Optional[CompletionLogProbs]]:
        """The echoed prompt text and, with logprobs, the prompt's token entries."""
        if not request.echo:
            return "", None
        ids = prompt["prompt_token_ids"]
        text = prompt.get("prompt")
        if text is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if request.logprobs is None:
            return text, None
        scores = output.prompt_logprobs or [None] * len(ids)
        positions = []
        for token_id, entry in zip(ids, scores):
            own = entry.get(token_id) if entry else None
            if own is not None and own.decoded_token is not None:
                token_text = own.decoded_token
            else:  # the first prompt token has no entry
                token_text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            positions.append((token_text, entry, token_id))
        return text, self._logprobs(request.logprobs, positions, 0, None)

    @staticmethod
    def _positions(c: CompletionOutput, as_token_ids: Optional[bool] = False) -> list[_Position]:
        logprobs = c.logprobs or [None] * len(c.token_ids)
        if as_token_ids:
            logprobs = [_ids_as_text(entry) for entry in logprobs]
            return list(zip([f"token_id:{t}" for t in c.token_ids], logprobs, c.token_ids))
        return list(zip(c.token_texts, logprobs, c.token_ids))

    @staticmethod
    def _logprobs(num_top: Optional[int], positions: Sequence[_Position], offset: int,
                  into: Optional[CompletionLogProbs]) -> CompletionLogProbs:
        """Append positions to `into` (or a new object); offsets start at `offset`."""
        result = into or CompletionLogProbs()
        for token_text, entry, token_id in positions:
            result.tokens.append(token_text)
            result.text_offset.append(offset)
            offset += len(token_text)
            own = entry.get(token_id) if entry else None
            result.token_logprobs.append(clamp_logprob(own.logprob) if own is not None else None)
            if entry is None or num_top is None:
                result.top_logprobs.append(None)
                continue
            # vLLM's shape: the sampled token plus the num_top most likely, keyed by text.
            top = {}
            for t, lp in entry.items():
                if t == token_id or (lp.rank is not None and lp.rank <= num_top):
                    key = token_text if t == token_id else (lp.decoded_token or "")
                    top.setdefault(key, clamp_logprob(lp.logprob))
            result.top_logprobs.append(top)
        return result

    # ------------------------------------------------------------------ stream
    async def _stream(self, request: CompletionRequest, request_id: str, model: str, prompts: list[TokensPrompt],
                      streams: list[RequestStream]) -> AsyncIterator[str]:
        sent_chars: dict[int, int] = {}  # choice index -> characters sent (text_offset base)
        cached = [0] * len(prompts)
        completion_tokens = 0
        try:
            # aclosing: a stream closed early closes the merge too, which cancels its pending reads.
            async with aclosing(self.merge(streams)) as merged:
                async for i, output in merged:
                    cached[i] = output.num_cached_tokens
                    completion_tokens += sum(len(c.token_ids) for c in output.outputs)
                    for choice in self._stream_choices(request, i, prompts[i], output, sent_chars):
                        usage = None
                        if request.continuous_usage:
                            usage = UsageInfo.of(sum(len(p["prompt_token_ids"]) for p in prompts), completion_tokens,
                                                 sum(cached))
                        yield sse(CompletionStreamResponse(id=request_id, model=model, choices=[choice], usage=usage))
            if request.include_usage:
                prompt_tokens = sum(len(p["prompt_token_ids"]) for p in prompts)
                usage = UsageInfo.of(prompt_tokens, completion_tokens, sum(cached))
                yield sse(CompletionStreamResponse(id=request_id, model=model, choices=[], usage=usage))
        except Exception as e:
            status, message, param, err_type = classify(e)
            logger.error("Completion stream %s failed: %s", request_id, message, exc_info=status >= 500)
            yield f"data: {json.dumps(error_body(message, status, param, err_type))}\n\n"
        finally:
            for stream in streams:
                stream.abort()
        yield SSE_DONE

    def _stream_choices(self, request: CompletionRequest, prompt_index: int, prompt: TokensPrompt,
                        output: RequestOutput, sent_chars: dict[int, int]) -> list[CompletionResponseStreamChoice]:
        """One chunk choice per sample that has news; a sample's first chunk carries the echo."""
        choices = []
        for c in output.outputs:
            index = prompt_index * request.n + c.index
            first = index not in sent_chars
            text, logprobs = self._echo_prefix(request, prompt, output) if first else ("", None)
            sent_chars.setdefault(index, 0)
            if not (text or c.text or c.token_ids or c.finish_reason):
                continue
            if request.logprobs is not None:
                logprobs = self._logprobs(request.logprobs, self._positions(c, request.return_tokens_as_token_ids),
                                          sent_chars[index] + len(text), logprobs)
            text += c.text
            sent_chars[index] += len(text)
            choices.append(CompletionResponseStreamChoice(index=index, text=text, logprobs=logprobs,
                                                          finish_reason=c.finish_reason, stop_reason=c.stop_reason))
        return choices


def _ids_as_text(entry: Optional[dict[int, Logprob]]) -> Optional[dict[int, Logprob]]:
    """A logprob entry whose decoded tokens read "token_id:<id>" (return_tokens_as_token_ids)."""
    if entry is None:
        return None
    return {t: replace(lp, decoded_token=f"token_id:{t}") for t, lp in entry.items()}
