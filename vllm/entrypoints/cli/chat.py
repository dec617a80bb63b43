"""`vllm chat`: an interactive chat client of a running OpenAI-compatible server.

What it owns: the subcommand's flags and the conversation. Usage:
`vllm chat [--url URL] [--model-name NAME] [--system-prompt TEXT] [-q MESSAGE] [--api-key KEY]
[--max-tokens N] [--temperature T]` (`--model` is accepted for `--model-name`; the last two
are ours, vLLM's client leaves sampling to the server).

Invariants:
- The conversation sent with each line is the optional system prompt, then every earlier
  user line and the answer printed for it (streamed answers, joined), then the new line:
  what a chat UI sends. A turn whose request failed is dropped from the conversation.
- `--quick MESSAGE` sends one message, prints the answer and exits; otherwise stdin is read
  line by line until EOF (see `openai_client` for output and error rules).
"""

from __future__ import annotations

import argparse

from vllm.entrypoints.cli import openai_client

DESCRIPTION = "Chat with the model of a running OpenAI-compatible server (streamed answers)."


def register(subparsers, parser_class: type[argparse.ArgumentParser], populate: bool = True) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("chat", help=DESCRIPTION, description=DESCRIPTION, usage="vllm chat [options]")
    assert isinstance(parser, parser_class)
    if populate:
        openai_client.add_client_args(parser, "MESSAGE",
                                      "Send MESSAGE as the only user message, print the answer, then exit.")
        parser.add_argument("--system-prompt", default=None, metavar="TEXT",
                            help="A system message that opens the conversation.")
    parser.set_defaults(dispatch=run)
    return parser


def run(args: argparse.Namespace) -> None:
    conversation: list[dict[str, str]] = []
    if args.system_prompt is not None:
        conversation.append({"role": "system", "content": args.system_prompt})
    kwargs = openai_client.sampling_kwargs(args, "max_completion_tokens")

    def make_ask(client, model: str):
        def ask(text: str) -> None:
            messages = conversation + [{"role": "user", "content": text}]
            stream = client.chat.completions.create(model=model, messages=messages, stream=True, **kwargs)
            answer = openai_client.print_stream(stream, lambda choice: choice.delta.content)
            conversation.extend([messages[-1], {"role": "assistant", "content": answer}])

        return ask

    openai_client.run_session("chat", args, "Please enter a message for the chat model:", make_ask)
