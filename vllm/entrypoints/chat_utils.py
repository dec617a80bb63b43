"""Rendering OpenAI-style chat messages into a prompt with the model's chat template.

Shared by `LLM.chat` and the server. Message content may be a string or a list of
OpenAI content parts (text parts, whose `text` must be a string, are joined); the rendered
prompt must be valid Unicode (a lone surrogate is a ValueError, not a tokenizer crash);
roles are passed through unchanged, so custom roles (e.g. an intrinsic's role) reach the
template. `documents`, `tools` and any `chat_template_kwargs` are handed to the template as
variables.

On a checkpoint with embedded adapters (Granite Switch), `chat_template_kwargs`'s
`adapter_name` selects one: the checkpoint's own template places its control token, and
`check_adapter_name` refuses a name the checkpoint does not embed.
"""

from __future__ import annotations

import os
from typing import Any, Optional

from vllm.inputs import lone_surrogate


def check_adapter_name(model_config: Any, chat_template_kwargs: Optional[dict]) -> None:
    """ValueError if `adapter_name` names no adapter of a checkpoint with embedded adapters."""
    switch = getattr(model_config.hf_config, "switch", None)
    name = (chat_template_kwargs or {}).get("adapter_name")
    if switch is not None and name is not None:
        if not isinstance(name, str):
            raise ValueError(f"chat_template_kwargs.adapter_name must be a string, got {type(name).__name__}.")
        switch.adapter_index(name)


def load_chat_template(chat_template: Optional[str]) -> Optional[str]:
    """`chat_template` is a Jinja string or a path to a file holding one."""
    if chat_template is None:
        return None
    if os.path.isfile(chat_template):
        with open(chat_template) as f:
            return f.read()
    if "{" not in chat_template:
        raise ValueError(f"chat_template {chat_template!r} is neither a file nor a Jinja template.")
    return chat_template


def _text_of(content: Any) -> Any:
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, str):
                parts.append(part)
            elif isinstance(part, dict) and part.get("type") in ("text", "input_text"):
                text = part.get("text", "")
                if not isinstance(text, str):
                    raise ValueError(f"A {part['type']!r} content part's 'text' must be a string, got "
                                     f"{type(text).__name__}.")
                parts.append(text)
            else:
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise ValueError(f"Unsupported message content part {kind!r}: only text parts are supported.")
        return "".join(parts)
    raise ValueError(f"Message content must be a string or a list of parts, got {type(content).__name__}.")


def normalize_messages(messages: list[dict]) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects.")
    result = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}] must be an object with a string 'role'.")
        normalized = {k: v for k, v in message.items() if v is not None}
        normalized["content"] = _text_of(message.get("content"))
        if normalized["content"] is None:
            normalized["content"] = ""
        result.append(normalized)
    return result


def apply_chat_template(
    tokenizer,
    messages: list[dict],
    chat_template: Optional[str] = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: Optional[list[dict]] = None,
    documents: Optional[list[dict]] = None,
    chat_template_kwargs: Optional[dict[str, Any]] = None,
) -> str:
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message and add_generation_prompt cannot both be true.")
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if not template:
        raise ValueError(
            "The tokenizer has no chat template and none was given; pass chat_template (--chat-template)."
        )
    # continue_final_message continues whatever role the last message has: a custom
    # role's empty turn renders as just its header, e.g. an aLoRA's invocation.
    conversation = normalize_messages(messages)
    kwargs = dict(chat_template_kwargs or {})
    try:
        text = tokenizer.apply_chat_template(
            conversation,
            chat_template=template,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents or None,
            **kwargs,
        )
    except ValueError:
        raise
    except Exception as e:  # jinja2 errors: the template rejected these messages
        raise ValueError(f"The chat template could not render these messages: {e}") from e
    problem = lone_surrogate(text)  # in a message, tool or document: no tokenizer encodes it
    if problem is not None:
        raise ValueError(f"The messages hold invalid text: {problem}; strings must be valid Unicode (UTF-8).")
    return text
