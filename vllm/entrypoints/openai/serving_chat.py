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
from typing import AsyncIterator, Optional, Union

from vllm.engine.async_llm import AsyncLLM, RequestStream
from vllm.entrypoints.chat_utils import apply_chat_template, check_adapter_name
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
    random_id,
    ranked,
    sse,
)
from vllm.entrypoints.openai.request_logger import RequestLogger
from vllm.entrypoints.openai.serving_engine import OpenAIServing
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.inputs import TokensPrompt
from vllm.logger import init_logger
from vllm.outputs import CompletionOutput

logger = init_logger(__name__)


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, chat_template: Optional[str] = None,
                 response_role: str = "assistant", request_logger: Optional[RequestLogger] = None):
        super().__init__(engine, models, request_logger)
        self.chat_template = chat_template
        self.response_role = response_role

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
        params = request.to_sampling_params(self.max_tokens_for(len(ids), request.requested_max_tokens),
                                            self.sampling_defaults)
        request_id = random_id("chatcmpl")
        streams = await self.submit(request_id, [TokensPrompt(prompt=text, prompt_token_ids=ids)], [params],
                                    lora_request, request.cache_salt)
        model = self.model_name(request.model)
        # Without a generation prompt the model continues the last message's role.
        role = self.response_role if request.add_generation_prompt else request.messages[-1].role
        if request.stream:
            return self._stream(request, request_id, model, role, streams[0])
        [output] = await self.collect_all(streams)
        choices = [
            ChatCompletionResponseChoice(
                index=c.index,
                message=ChatMessage(role=role, content=c.text),
                logprobs=self._logprobs(c, request.top_logprobs or 0) if request.logprobs else None,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
            for c in output.outputs
        ]
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
    def _logprobs(c: CompletionOutput, top_n: int) -> ChatCompletionLogProbs:
        content = []
        for token_id, token_text, entry in zip(c.token_ids, c.token_texts, c.logprobs or []):
            top = []
            for t, lp in ranked(entry, top_n):
                # The sampled token is named by the text it added, like the entry itself.
                text = token_text if t == token_id else (lp.decoded_token or "")
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
                      stream: RequestStream) -> AsyncIterator[str]:
        def chunk(choices, usage: Optional[UsageInfo] = None) -> str:
            return sse(ChatCompletionStreamResponse(id=request_id, model=model, choices=choices, usage=usage))

        completion_tokens, last = 0, None
        try:
            for i in range(request.n):
                yield chunk([ChatCompletionResponseStreamChoice(index=i, delta=DeltaMessage(role=role, content=""))])
            async for output in stream:
                last = output
                for c in output.outputs:
                    completion_tokens += len(c.token_ids)
                    if not (c.text or c.token_ids or c.finish_reason):
                        continue
                    logprobs = self._logprobs(c, request.top_logprobs or 0) if request.logprobs else None
                    yield chunk([ChatCompletionResponseStreamChoice(
                        index=c.index, delta=DeltaMessage(content=c.text), logprobs=logprobs,
                        finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                    )])
            if request.include_usage and last is not None:
                usage = UsageInfo.of(len(last.prompt_token_ids), completion_tokens, last.num_cached_tokens)
                yield chunk([], usage)
        except Exception as e:
            status, message, param, err_type = classify(e)
            logger.error("Chat stream %s failed: %s", request_id, message, exc_info=status >= 500)
            yield f"data: {json.dumps(error_body(message, status, param, err_type))}\n\n"
        finally:
            stream.abort()
        yield SSE_DONE
