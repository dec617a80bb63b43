"""`OpenAIServingResponses`: POST /v1/responses (OpenAI's Responses API, text and structured output).

What it owns: turning a `ResponsesRequest` into one engine request (the conversation rendered
by the chat endpoint's own `render_chat`, so the prompt ids are the ones a chat completion
with the same messages sends; sampling defaults from the model's generation config, as on
the other routes; `text.format` as the structured-output constraint), and turning its
outputs into a `response` object or the Responses event stream.

Invariants:
- Output items: a `reasoning` item first when the server's --reasoning-parser found
  thinking text, then always one `message` item with one `output_text` part (text may be
  ""). Streamed and whole responses are built from the same `ChoiceParser` split, so the
  streamed deltas concatenate to the whole response's texts.
- `status` is `incomplete` with `incomplete_details.reason = "max_output_tokens"` when the
  output hit its token limit, `completed` otherwise; the message item carries the same status.
- A stream is server-sent events `event: TYPE` / `data: {...}` with `sequence_number`s
  0, 1, 2, ... in order: response.created, response.in_progress, then per item
  output_item.added, content_part.added, the text deltas, the text's done event,
  content_part.done, output_item.done, and last response.completed (response.incomplete
  when the status is incomplete, as OpenAI does). No `[DONE]` (OpenAI sends none).
- Errors before the stream starts are HTTP errors; an error after it started is one
  `error` event (`code`, `message`, `param`) that ends the stream. A stream that stops
  early (client disconnect, error) aborts its engine request.
"""

from __future__ import annotations

import json
from typing import Any, AsyncIterator, Callable, Optional, Union

from vllm.entrypoints.openai.chat_output import ChoiceParser, ToolPolicy
from vllm.entrypoints.openai.errors import BadRequestError, classify, error_body
from vllm.entrypoints.openai.responses_protocol import (
    IncompleteDetails,
    OutputMessage,
    OutputText,
    ReasoningItem,
    ReasoningText,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    new_id,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_engine import OpenAIServing
from vllm.inputs import TokensPrompt
from vllm.logger import init_logger
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

logger = init_logger(__name__)

MESSAGE, REASONING = "message", "reasoning"
Item = Union[ReasoningItem, OutputMessage]


def _status(finish_reason: Optional[str]) -> str:
    return "incomplete" if finish_reason == "length" else "completed"


def _item(kind: str, item_id: str, text: Optional[str], status: str) -> Item:
    """An output item; `text=None` gives the item without its content part (as first announced)."""
    if kind == REASONING:
        return ReasoningItem(id=item_id, status=status, content=[] if text is None else [ReasoningText(text=text)])
    return OutputMessage(id=item_id, status=status, content=[] if text is None else [OutputText(text=text)])


def _part(kind: str, text: str) -> dict[str, Any]:
    return (ReasoningText(text=text) if kind == REASONING else OutputText(text=text)).model_dump()


class ResponseBuilder:
    """One response, whole or as its event stream, from one request's outputs."""

    def __init__(self, request: ResponsesRequest, response_id: str, model: str, parser: ChoiceParser,
                 count_tokens: Callable[[str], int], params: SamplingParams):
        self.parser = parser
        self.count_tokens = count_tokens
        self.echo = dict(  # the request fields a response reports
            id=response_id, model=model, instructions=request.instructions,
            max_output_tokens=request.max_output_tokens, metadata=request.metadata, reasoning=request.reasoning,
            temperature=params.temperature, top_p=params.top_p, text={"format": request.text_format},
            tool_choice=request.tool_choice or "auto", user=request.user,
        )
        self.created_at: Optional[int] = None

    def response(self, status: str, output: list[Item], usage: Optional[ResponseUsage] = None) -> ResponseObject:
        incomplete = IncompleteDetails(reason="max_output_tokens") if status == "incomplete" else None
        result = ResponseObject(status=status, output=output, usage=usage, incomplete_details=incomplete,
                                **self.echo, **({"created_at": self.created_at} if self.created_at else {}))
        self.created_at = result.created_at  # every event of a stream names the same moment
        return result

    def usage(self, output: RequestOutput, output_tokens: int, reasoning: Optional[str]) -> ResponseUsage:
        # reasoning_tokens: the thinking text re-tokenised (markers excluded): an estimate.
        return ResponseUsage.of(len(output.prompt_token_ids), output_tokens, output.num_cached_tokens,
                                self.count_tokens(reasoning) if reasoning else 0)

    def whole(self, output: RequestOutput) -> ResponseObject:
        [c] = output.outputs
        fields = self.parser.parse(c.text)
        status = _status(c.finish_reason)
        items: list[Item] = []
        if fields.reasoning:
            items.append(_item(REASONING, new_id("rs"), fields.reasoning, "completed"))
        items.append(_item(MESSAGE, new_id("msg"), fields.content or "", status))
        return self.response(status, items, self.usage(output, len(c.token_ids), fields.reasoning))

    async def events(self, stream: Any) -> AsyncIterator[str]:
        """The event stream; `stream` yields the request's DELTA outputs and has `abort()`."""
        out = _EventWriter()
        try:
            started = self.response("in_progress", []).model_dump()
            yield out.event("response.created", response=started)
            yield out.event("response.in_progress", response=started)
            last, finish, tokens, reasoning = None, None, 0, ""
            async for output in stream:
                last = output
                for c in output.outputs:
                    tokens += len(c.token_ids)
                    fields = self.parser.feed(c.text)
                    if c.finish_reason is not None:
                        finish = c.finish_reason
                        fields = fields.then(self.parser.finish())
                    reasoning += fields.reasoning or ""
                    for kind, piece in ((REASONING, fields.reasoning), (MESSAGE, fields.content)):
                        if piece:
                            for event in out.append(kind, piece):
                                yield event
            status = _status(finish)
            if out.kind != MESSAGE:  # no answer text: an empty message item, as in a whole response
                for event in out.close("completed") + out.open(MESSAGE):
                    yield event
            for event in out.close(status):
                yield event
            usage = self.usage(last, tokens, reasoning) if last is not None else None
            final = self.response(status, out.items, usage).model_dump()
            yield out.event("response.completed" if status == "completed" else "response.incomplete", response=final)
        except Exception as e:
            code, message, param, err_type = classify(e)
            logger.error("Responses stream %s failed: %s", self.echo["id"], message, exc_info=code >= 500)
            yield out.event("error", code=error_body(message, code, param, err_type)["error"]["type"],
                            message=message, param=param)
        finally:
            stream.abort()


class _EventWriter:
    """Numbered events, and the item whose text is streaming now (one at a time)."""

    def __init__(self):
        self.seq = 0
        self.items: list[Item] = []  # finished items, in output order
        self.kind: Optional[str] = None
        self.item_id = ""
        self.text = ""

    def event(self, type_: str, **fields: Any) -> str:
        data = {"type": type_, **fields, "sequence_number": self.seq}
        self.seq += 1
        return f"event: {type_}\ndata: {json.dumps(data)}\n\n"

    def _where(self) -> dict[str, Any]:
        return {"item_id": self.item_id, "output_index": len(self.items), "content_index": 0}

    def append(self, kind: str, piece: str) -> list[str]:
        events = [] if self.kind == kind else self.close("completed") + self.open(kind)
        self.text += piece
        if kind == MESSAGE:
            events.append(self.event("response.output_text.delta", **self._where(), delta=piece, logprobs=[]))
        else:
            events.append(self.event("response.reasoning_text.delta", **self._where(), delta=piece))
        return events

    def open(self, kind: str) -> list[str]:
        self.kind, self.item_id, self.text = kind, new_id("msg" if kind == MESSAGE else "rs"), ""
        item = _item(kind, self.item_id, None, "in_progress").model_dump()
        return [self.event("response.output_item.added", output_index=len(self.items), item=item),
                self.event("response.content_part.added", **self._where(), part=_part(kind, ""))]

    def close(self, status: str) -> list[str]:
        """Finish the streaming item (if any); a reasoning item always completes."""
        if self.kind is None:
            return []
        kind, where = self.kind, self._where()
        if kind == MESSAGE:
            events = [self.event("response.output_text.done", **where, text=self.text, logprobs=[])]
        else:
            events = [self.event("response.reasoning_text.done", **where, text=self.text)]
            status = "completed"
        events.append(self.event("response.content_part.done", **where, part=_part(kind, self.text)))
        item = _item(kind, self.item_id, self.text, status)
        events.append(self.event("response.output_item.done", output_index=where["output_index"],
                                 item=item.model_dump()))
        self.items.append(item)
        self.kind = None
        return events


class OpenAIServingResponses(OpenAIServing):
    def __init__(self, chat: OpenAIServingChat):
        """Shares the chat endpoint's template, reasoning parser and request logger."""
        super().__init__(chat.engine, chat.models, chat.request_logger)
        self.chat = chat

    async def create_response(self, request: ResponsesRequest) -> Union[ResponseObject, AsyncIterator[str]]:
        lora_request = self.models.resolve(request.model)
        text, ids = self.chat.render_chat(request.model, request.messages(), True, False, None, None,
                                          request.template_kwargs(), False)
        params = self._sampling_params(request, len(ids))
        response_id = new_id("resp")
        streams = await self.submit(response_id, [TokensPrompt(prompt=text, prompt_token_ids=ids)], [params],
                                    lora_request)
        parser = ChoiceParser(ToolPolicy("none"), self.chat.reasoning_parser, text)
        builder = ResponseBuilder(request, response_id, self.model_name(request.model), parser,
                                  lambda s: len(self.tokenizer.encode(s, add_special_tokens=False)), params)
        if request.stream:
            return builder.events(streams[0])
        [output] = await self.collect_all(streams)
        return builder.whole(output)

    def _sampling_params(self, request: ResponsesRequest, num_prompt_tokens: int) -> SamplingParams:
        requested = request.max_output_tokens
        room = self.max_model_len - num_prompt_tokens
        if requested is not None and 0 < room < requested:
            raise BadRequestError(
                f"'max_output_tokens' is too large: {requested}. This model's maximum context length is "
                f"{self.max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
                f"({requested} > {self.max_model_len} - {num_prompt_tokens}).", param="max_output_tokens")
        defaults = self.sampling_defaults
        return SamplingParams(
            temperature=defaults.get("temperature", 1.0) if request.temperature is None else request.temperature,
            top_p=defaults.get("top_p", 1.0) if request.top_p is None else request.top_p,
            top_k=defaults.get("top_k", 0),
            min_p=defaults.get("min_p", 0.0),
            repetition_penalty=defaults.get("repetition_penalty", 1.0),
            max_tokens=self.max_tokens_for(num_prompt_tokens, requested),
            structured_outputs=request.structured_outputs(),
        )
