"""`vllm serve [MODEL]`: start the OpenAI-compatible server.

What it owns: the subcommand's parser (frontend and engine flags from
`vllm.entrypoints.openai.cli_args`) and running the server until it is stopped.
Invariant: a configuration error (bad flag value, unreadable model, adapter that fails
to load) ends the command with a one-line message and exit status 1, not a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

DESCRIPTION = "Start the OpenAI-compatible server for MODEL (and its LoRA / aLoRA adapters)."


def register(subparsers, parser_class: type[argparse.ArgumentParser], populate: bool = True) -> argparse.ArgumentParser:
    """Add `serve`; its flags (which import the engine, hence torch) only when `populate`."""
    parser = subparsers.add_parser("serve", help=DESCRIPTION, description=DESCRIPTION,
                                   usage="vllm serve [MODEL] [options]")
    # argparse builds subparsers with the parent's class, which already normalises flags.
    assert isinstance(parser, parser_class)
    if populate:
        from vllm.entrypoints.openai.cli_args import make_arg_parser

        make_arg_parser(parser)
    parser.set_defaults(dispatch=run)
    return parser


def run(args: argparse.Namespace) -> None:
    from vllm.entrypoints.openai.api_server import run_server

    try:
        asyncio.run(run_server(args))
    except ValueError as e:
        print(f"vllm serve: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        pass
