"""`OpenAIServing`: what the completions and chat handlers share.

What it owns: model resolution (base model or adapter), the context-length rules
applied before a request reaches the engine, submission of one or several prompts,
merging the streams of a multi-prompt request, and usage accounting.

Invariants:
- The tokenizer is only read here (encode/decode, never truncation or padding
  settings), which is safe next to the engine thread's use of it.
- A prompt with `max_model_len` tokens or more, or whose `max_tokens` does not fit
  beside it, is refused with 400 before anything is queued (vLLM's messages).
- Every stream handed out is aborted when its consumer stops early, including when
  submitting a later prompt of the same request fails.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Optional, Sequence

from vllm.engine.async_llm import AsyncLLM, RequestStream
from vllm.entrypoints.openai.errors import BadRequestError
from vllm.entrypoints.openai.request_logger import RequestLogger
from vllm.entrypoints.openai.response_models import UsageInfo, random_id
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, models: OpenAIServingModels, request_logger: Optional[RequestLogger] = None):
        self.engine = engine
        self.request_logger = request_logger
        self.models = models
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.model_config.max_model_len
        self.max_num_seqs = engine.engine.vllm_config.scheduler_config.max_num_seqs
        self.sampling_defaults = engine.model_config.sampling_defaults

    def model_name(self, requested: Optional[str]) -> str:
        """The model a response names: the adapter asked for, else the first served name."""
        return self.models.base_model_name if self.models.is_base_model(requested) else requested

    def truncate(self, ids: list[int], keep: Optional[int]) -> list[int]:
        """`truncate_prompt_tokens`: the last `keep` ids (-1: the last max_model_len)."""
        if keep is None:
            return ids
        keep = self.max_model_len if keep == -1 else keep
        return ids[-keep:]

    @staticmethod
    def request_id(prefix: str, given: Optional[str]) -> str:
        """vLLM's response ids: "<prefix>-<client request_id>", else a random one."""
        return f"{prefix}-{given}" if given else random_id(prefix)

    def max_tokens_for(self, num_prompt_tokens: int, requested: Optional[int]) -> int:
        """The request's output budget; raises 400 when prompt and output do not fit."""
        if num_prompt_tokens >= self.max_model_len:
            raise BadRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, your request has "
                f"{num_prompt_tokens} input tokens. Please reduce the length of the input messages.",
                param="messages" if requested is None else None,
            )
        room = self.max_model_len - num_prompt_tokens
        if requested is None:
            default = self.sampling_defaults.get("max_tokens")
            return room if default is None else min(room, default)
        if requested > room:
            raise BadRequestError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {requested}. This model's maximum context "
                f"length is {self.max_model_len} tokens and your request has {num_prompt_tokens} input tokens "
                f"({requested} > {self.max_model_len} - {num_prompt_tokens}).",
                param="max_tokens",
            )
        return requested

    async def submit(self, request_id: str, prompts: Sequence[TokensPrompt], params: Sequence[SamplingParams],
                     lora_request: Optional[LoRARequest], cache_salt: Optional[str] = None) -> list[RequestStream]:
        """Queue every prompt (ids `request_id-i` when several); all or nothing."""
        if cache_salt is not None:
            prompts = [TokensPrompt(**prompt, cache_salt=cache_salt) for prompt in prompts]
        if any(p.n > self.max_num_seqs for p in params):
            # More samples than can ever run together would only queue behind each other.
            raise BadRequestError(f"n must be at most max_num_seqs ({self.max_num_seqs}).", param="n")
        streams: list[RequestStream] = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = request_id if len(prompts) == 1 else f"{request_id}-{i}"
                if self.request_logger is not None:
                    self.request_logger.log_inputs(rid, prompt, p, lora_request)
                streams.append(await self.engine.add_request(rid, prompt, p, lora_request))
        except BaseException:
            for stream in streams:
                stream.abort()
            raise
        return streams

    @staticmethod
    async def collect_all(streams: list[RequestStream]) -> list[RequestOutput]:
        tasks = [asyncio.ensure_future(stream.collect()) for stream in streams]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # a cancelled collect aborts its request
                task.cancel()
            raise

    @staticmethod
    async def merge(streams: list[RequestStream]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as they come, tagged with the stream's index."""
        pending = {asyncio.ensure_future(s.__anext__()): i for i, s in enumerate(streams)}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    try:
                        output = task.result()
                    except StopAsyncIteration:
                        continue
                    pending[asyncio.ensure_future(streams[i].__anext__())] = i
                    yield i, output
        finally:
            for task in pending:
                task.cancel()
            for stream in streams:
                stream.abort()

    @staticmethod
    def usage(outputs: Sequence[RequestOutput]) -> UsageInfo:
        prompt = sum(len(o.prompt_token_ids) for o in outputs)
        completion = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return UsageInfo.of(prompt, completion, cached)
