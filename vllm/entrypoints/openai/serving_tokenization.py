"""`OpenAIServingTokenization`: POST /tokenize and /detokenize (vLLM's routes and shapes).

What it owns: turning a prompt, or a conversation rendered exactly as the chat endpoint
renders it, into token ids (`{"count", "max_model_len", "tokens", "token_strs"}`), and
token ids back into text (`{"prompt"}`). Invariants: the chat form's ids are the ids a
chat completion with the same fields would send to the engine; ids outside the
vocabulary are a 400.
"""

from __future__ import annotations

from typing import Union

from vllm.entrypoints.openai.errors import BadRequestError
from vllm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeChatRequest, TokenizeCompletionRequest
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat


class OpenAIServingTokenization:
    def __init__(self, chat: OpenAIServingChat):
        self.chat = chat
        self.tokenizer = chat.tokenizer
        self.models = chat.models

    def tokenize(self, request: Union[TokenizeCompletionRequest, TokenizeChatRequest]) -> dict:
        self.models.resolve(request.model)  # 404 for an unknown model
        if isinstance(request, TokenizeChatRequest):
            messages = [m.model_dump(exclude_none=True) for m in request.messages]
            _, ids = self.chat.render_chat(request.model, messages, request.add_generation_prompt,
                                           request.continue_final_message, request.tools, request.documents,
                                           request.chat_template_kwargs, request.add_special_tokens)
        else:
            ids = self.tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        result = {"count": len(ids), "max_model_len": self.chat.max_model_len, "tokens": ids, "token_strs": None}
        if request.return_token_strs:
            result["token_strs"] = self.tokenizer.convert_ids_to_tokens(ids)
        return result

    def detokenize(self, request: DetokenizeRequest) -> dict:
        self.models.resolve(request.model)
        vocab = self.chat.engine.model_config.vocab_size
        bad = [t for t in request.tokens if not 0 <= t < vocab]
        if bad:
            raise BadRequestError(f"Token ids must be in [0, {vocab}); got {bad[:5]}.", param="tokens")
        return {"prompt": self.tokenizer.decode(request.tokens)}
