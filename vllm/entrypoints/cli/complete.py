"""`vllm complete`: a text-completion client of a running OpenAI-compatible server.

What it owns: the subcommand's flags. Usage: `vllm complete [--url URL] [--model-name NAME]
[-q PROMPT] [--max-tokens N] [--api-key KEY] [--temperature T]` (`--model` is accepted for
`--model-name`; `--temperature` is ours).

Invariants:
- Every prompt is completed on its own (no history): `--quick PROMPT` completes one and
  exits, otherwise each stdin line is a prompt until EOF (see `openai_client` for output
  and error rules).
"""

from __future__ import annotations

import argparse

from vllm.entrypoints.cli import openai_client

DESCRIPTION = "Complete prompts with the model of a running OpenAI-compatible server (streamed)."


def register(subparsers, parser_class: type[argparse.ArgumentParser], populate: bool = True) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("complete", help=DESCRIPTION, description=DESCRIPTION,
                                   usage="vllm complete [options]")
    assert isinstance(parser, parser_class)
    if populate:
        openai_client.add_client_args(parser, "PROMPT", "Complete PROMPT, print the completion, then exit.")
    parser.set_defaults(dispatch=run)
    return parser


def run(args: argparse.Namespace) -> None:
    kwargs = openai_client.sampling_kwargs(args, "max_tokens")

    def make_ask(client, model: str):
        def ask(prompt: str) -> None:
            stream = client.completions.create(model=model, prompt=prompt, stream=True, **kwargs)
            openai_client.print_stream(stream, lambda choice: choice.text)

        return ask

    openai_client.run_session("complete", args, "Please enter prompt to complete:", make_ask)
