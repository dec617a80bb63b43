"""`vllm run-batch -i INPUT.jsonl -o OUTPUT.jsonl [--model MODEL] [options]`: run an OpenAI
batch file through an in-process engine (no server).

What it owns: registering the subcommand; the flags, the run and the file formats are
`vllm.entrypoints.openai.run_batch`'s (also runnable as
`python -m vllm.entrypoints.openai.run_batch`).
Invariant: a configuration error (URL instead of a path, unreadable input, bad model or
adapter) ends the command with a one-line message and exit status 1; failed lines do not.
"""

from __future__ import annotations

import argparse

DESCRIPTION = ("Run an OpenAI batch file (/v1/chat/completions and /v1/completions lines) through an "
               "in-process engine and write one result line per request, in input order.")


def register(subparsers, parser_class: type[argparse.ArgumentParser], populate: bool = True) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("run-batch", help=DESCRIPTION, description=DESCRIPTION,
                                   usage="vllm run-batch -i INPUT.jsonl -o OUTPUT.jsonl [--model MODEL] [options]")
    assert isinstance(parser, parser_class)
    if populate:
        from vllm.entrypoints.openai.run_batch import make_arg_parser

        make_arg_parser(parser)
    parser.set_defaults(dispatch=run)
    return parser


def run(args: argparse.Namespace) -> None:
    from vllm.entrypoints.openai import run_batch

    run_batch.run(args)
