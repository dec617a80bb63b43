"""The `vllm` command: `vllm --version`, `vllm serve [MODEL] [flags]`.

What it owns: the top-level parser, subcommand dispatch, and `FlexibleArgumentParser`,
which accepts every `--foo-bar` flag also as `--foo_bar` (as vLLM's parser does) by
normalising option names, never option values, before argparse sees them.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from vllm.version import __version__


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace=None):
        argv = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(normalize_flags(argv), namespace)


def normalize_flags(argv: list[str]) -> list[str]:
    """`--max_model_len=8` -> `--max-model-len=8`; values and positionals unchanged."""
    result = []
    for arg in argv:
        if arg == "--":  # everything after is positional
            result.extend(argv[len(result):])
            break
        if arg.startswith("--"):
            name, sep, value = arg.partition("=")
            arg = "--" + name[2:].replace("_", "-") + sep + value
        result.append(arg)
    return result


def make_parser() -> FlexibleArgumentParser:
    from vllm.entrypoints.cli import serve

    parser = FlexibleArgumentParser(prog="vllm", description="A compact LLM inference engine with vLLM's "
                                    "interface and first-class Activated LoRA (aLoRA).")
    parser.add_argument("-v", "--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    serve.register(subparsers, FlexibleArgumentParser)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-v", "--version"):  # answer without importing the engine
        print(__version__)
        return
    parser = make_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "dispatch"):
        parser.print_help()
        sys.exit(1)
    args.dispatch(args)


if __name__ == "__main__":
    main()
