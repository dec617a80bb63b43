"""`OpenAIServingChat`: POST /v1/chat/completions.

What it owns: rendering the conversation with the chat template (the tokenizer's or
`--chat-template`; with `documents`, `tools` and `chat_template_kwargs`), and turning
the outputs into OpenAI's chat response or its server-sent-event stream.

Invariants:
- The prompt is the rendered template tokenised without adding special tokens (the
  template places them), exactly what `LLM.chat` sends, so an aLoRA's invocation is
  searched in the same token ids offline and over HTTP.
- `logprobs.content[i].token` is the text the i-th token added, so the tokens
  concatenate exactly to `message.content` (granite-common computes offsets from them);
  `bytes` are that text's UTF-8 bytes.
- A stream sends each choice's role first (`delta.role`), then content deltas, the
  `finish_reason` in that choice's last chunk, an optional usage chunk with no choices,
  and always ends with `data: [DONE]`.
"""

from __future__ import annotations

import json
from typing import AsyncIterator, Callable, Optional, Union

from vllm.engine.async_llm import AsyncLLM, RequestStream
from vllm.entrypoints.chat_utils import apply_chat_template, check_adapter_name
from vllm.entrypoints.openai.chat_output import ChoiceParser, ToolPolicy
from vllm.entrypoints.openai.errors import BadRequestError, classify, error_body
from vllm.entrypoints.openai.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.response_models import (
    SSE_DONE,
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionResponseStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    clamp_logprob,
    prompt_logprobs_json,
    ranked,
    sse,
)
from vllm.entrypoints.openai.request_logger import RequestLogger
from vllm.entrypoints.openai.serving_engine import OpenAIServing
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.inputs import TokensPrompt
from vllm.logger import init_logger
from vllm.outputs import CompletionOutput
from vllm.reasoning import create_reasoning_parser
from vllm.sampling_params import StructuredOutputsParams

logger = init_logger(__name__)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, chat_template: Optional[str] = None,
                 response_role: str = "assistant", request_logger: Optional[RequestLogger] = None,
                 tool_parser: Optional[str] = None, reasoning_parser: Optional[str] = None):
        """`tool_parser`: the --tool-call-parser when --enable-auto-tool-choice is set;
        `reasoning_parser`: the --reasoning-parser."""
        super().__init__(engine, models, request_logger)
        self.chat_template = chat_template
        self.response_role = response_role
        self.tool_parser = tool_parser
        self.reasoning_parser = create_reasoning_parser(reasoning_parser) if reasoning_parser else None

    async def create_chat_completion(
        self, request: ChatCompletionRequest
    ) -> Union[ChatCompletionResponse, AsyncIterator[str]]:
        lora_request = self.models.resolve(request.model)
        if request.chat_template is not None:
            raise BadRequestError("A chat template in the request is not accepted; start the server with "
                                  "--chat-template instead.", param="chat_template")
        text, ids = self.render_chat(request.model, request.message_dicts(), request.add_generation_prompt,
                                     request.continue_final_message, request.tools, request.documents,
                                     request.template_kwargs(), request.add_special_tokens)
        kept = self.truncate(ids, request.truncate_prompt_tokens)
        if len(kept) < len(ids):
            text, ids = self.tokenizer.decode(kept, skip_special_tokens=False), kept
        policy = ToolPolicy.of(request.tools, request.tool_choice, request.parallel_tool_calls, self.tool_parser)
        params = request.to_sampling_params(self.max_tokens_for(len(ids), request.requested_max_tokens),
                                            self.sampling_defaults)
        if policy.schema is not None:
            if params.structured_outputs is not None:
                raise BadRequestError("tool_choice 'required' or a named function cannot be combined with structured "
                                      "outputs (response_format, structured_outputs).", param="tool_choice")
            params.structured_outputs = StructuredOutputsParams(json=policy.schema)
        request_id = self.request_id("chatcmpl", request.request_id)
        streams = await self.submit(request_id, [TokensPrompt(prompt=text, prompt_token_ids=ids)], [params],
                                    lora_request, request.cache_salt)
        model = self.model_name(request.model)
        # Without a generation prompt the model continues the last message's role.
        role = self.response_role if request.add_generation_prompt else request.messages[-1].role
        new_parser = lambda: ChoiceParser(policy, self.reasoning_parser, text)  # noqa: E731
        echo = _echo_text(request, role)
        if request.stream:
            return self._stream(request, request_id, model, role, streams[0], new_parser, echo, len(ids))
        [output] = await self.collect_all(streams)
        choices = []
        for c in output.outputs:
            parser = new_parser()
            fields = parser.parse(c.text)
            if echo:
                fields.content = echo + (fields.content or "")
            choices.append(ChatCompletionResponseChoice(
                index=c.index,
                # No tool call and no text: "" as before, so clients reading .content get a string.
                message=ChatMessage(role=role, content=fields.content if fields.content or fields.tool_calls else "",
                                    tool_calls=fields.tool_calls,
                                    reasoning=fields.reasoning, reasoning_content=fields.reasoning),
                logprobs=self._logprobs(c, request.top_logprobs or 0, request.return_tokens_as_token_ids)
                if request.logprobs else None,
                finish_reason=_finish_reason(c.finish_reason, parser),
                stop_reason=c.stop_reason,
            ))
        return ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=self.usage([output]),
                                      prompt_logprobs=prompt_logprobs_json(output.prompt_logprobs))

    def render_chat(self, model: Optional[str], messages: list[dict], add_generation_prompt: bool,
                    continue_final_message: bool, tools: Optional[list[dict]], documents: Optional[list[dict]],
                    chat_template_kwargs: Optional[dict], add_special_tokens: bool) -> tuple[str, list[int]]:
        """The prompt text and token ids of a conversation, as the chat endpoint sends them (an
        embedded adapter named as `model` becomes the template's `adapter_name`)."""
        template_kwargs = self.models.chat_template_kwargs(model, chat_template_kwargs)
        check_adapter_name(self.engine.model_config, template_kwargs)
        text = apply_chat_template(self.tokenizer, messages, self.chat_template, add_generation_prompt,
                                   continue_final_message, tools, documents, template_kwargs)
        return text, self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    @staticmethod
    def _logprobs(c: CompletionOutput, top_n: int, as_token_ids: Optional[bool] = False) -> ChatCompletionLogProbs:
        content = []
        texts = [f"token_id:{t}" for t in c.token_ids] if as_token_ids else c.token_texts
        for token_id, token_text, entry in zip(c.token_ids, texts, c.logprobs or []):
            top = []
            for t, lp in ranked(entry, top_n):
                # The sampled token is named by the text it added, like the entry itself.
                text = token_text if t == token_id else (
                    f"token_id:{t}" if as_token_ids else (lp.decoded_token or ""))
                top.append(ChatCompletionLogProb(token=text, logprob=clamp_logprob(lp.logprob),
                                                 bytes=list(text.encode())))
            own = entry.get(token_id)
            content.append(ChatCompletionLogProbsContent(
                token=token_text,
                logprob=clamp_logprob(own.logprob) if own is not None else clamp_logprob(float("-inf")),
                bytes=list(token_text.encode()),
                top_logprobs=top,
            ))
        return ChatCompletionLogProbs(content=content)

    async def _stream(self, request: ChatCompletionRequest, request_id: str, model: str, role: str,
                      stream: RequestStream, new_parser: Callable[[], ChoiceParser], echo: str,
                      prompt_tokens: int) -> AsyncIterator[str]:
        completion_tokens, last = 0, None

        def chunk(choices, usage: Optional[UsageInfo] = None) -> str:
            if usage is None and request.continuous_usage and choices:
                usage = UsageInfo.of(prompt_tokens, completion_tokens, last.num_cached_tokens if last else 0)
            return sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=choices, usage=usage))

        parsers = [new_parser() for _ in range(request.n)]
        try:
            for i in range(request.n):
                yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role=role, content=""))])
                if echo:
                    yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(content=echo))])
            async for output in stream:
                last = output
                for c in output.outputs:
                    completion_tokens += len(c.token_ids)
                    if not (c.text or c.token_ids or c.finish_reason):
                        continue
                    parser = parsers[c.index]
                    fields = parser.feed(c.text)
                    if c.finish_reason is not None:
                        fields = fields.then(parser.finish())
                    logprobs = self._logprobs(c, request.top_logprobs or 0, request.return_tokens_as_token_ids) \
                        if request.logprobs else None
                    if fields.is_empty() and c.finish_reason is None and logprobs is None:
                        continue  # held back by a parser (a possible marker): nothing to send yet
                    yield chunk([ChatCompletionResponseStreamChoice(
                        index=c.index, delta=DeltaMessage(content=fields.content, reasoning=fields.reasoning,
                                                          reasoning_content=fields.reasoning,
                                                          tool_calls=fields.tool_calls or None),
                        logprobs=logprobs, finish_reason=_finish_reason(c.finish_reason, parser),
                        stop_reason=c.stop_reason,
                    )])
            if request.include_usage and last is not None:
                yield chunk([], UsageInfo.of(prompt_tokens, completion_tokens, last.num_cached_tokens))
        except Exception as e:
            status, message, param, err_type = classify(e)
            logger.error("Chat stream %s failed: %s", request_id, message, exc_info=status >= 500)
            yield f"data: {json.dumps(error_body(message, status, param, err_type))}\n\n"
        finally:
            stream.abort()
        yield SSE_DONE


def _finish_reason(reason: Optional[str], parser: ChoiceParser) -> Optional[str]:
    """A choice that made tool calls finishes with "tool_calls" (unless cut by max_tokens), as in vLLM."""
    return "tool_calls" if reason == "stop" and parser.num_tool_calls else reason


def _echo_text(request: ChatCompletionRequest, role: str) -> str:
    """`echo`: the last message's text, prepended to the answer when the answer continues that
    message's role (as with continue_final_message), as vLLM does."""
    last = request.messages[-1]
    if not request.echo or last.role != role:
        return ""
    content = last.content
    if isinstance(content, list):
        return "".join(p if isinstance(p, str) else p.get("text", "") for p in content)
    return content or ""
