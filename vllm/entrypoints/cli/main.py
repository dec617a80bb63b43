"""The `vllm` command: `vllm --version`, `vllm serve [MODEL] [flags]`, `vllm chat`,
`vllm complete` and `vllm run-batch -i IN.jsonl -o OUT.jsonl [flags]`.

What it owns: the top-level parser, subcommand dispatch, and `FlexibleArgumentParser`,
which accepts every `--foo-bar` flag also as `--foo_bar` (as vLLM's parser does) by
normalising option names, never option values, before argparse sees them, and reads
`--config FILE.yaml` (a mapping of flag names to values) as if its flags were given,
flags on the command line winning over the file's.

Invariant: only the subcommand being run gets its flags built (`make_parser(populate=...)`):
the engine flags import torch, which the client commands (`chat`, `complete`) and
`vllm --help` do not need. Every subcommand module has `register(subparsers, parser_class,
populate)` and imports nothing heavy at module level.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Container, Optional, Sequence

from vllm.version import __version__


class FlexibleArgumentParser(argparse.ArgumentParser):
    def parse_known_args(self, args: Optional[Sequence[str]] = None, namespace=None):
        argv = normalize_flags(list(sys.argv[1:] if args is None else args))
        if "--config" in self._option_string_actions:
            argv = self._expand_config(argv)
        return super().parse_known_args(argv, namespace)

    def _expand_config(self, argv: list[str]) -> list[str]:
        """Replace `--config FILE` by the file's flags that the command line does not set."""
        path = None
        for i, arg in enumerate(argv):
            if arg == "--config" and i + 1 < len(argv):
                path, argv = argv[i + 1], argv[:i] + argv[i + 2:]
                break
            if arg.startswith("--config="):
                path, argv = arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
                break
        if path is None:
            return argv
        given = {arg.split("=", 1)[0] for arg in argv if arg.startswith("-")}
        return argv + [a for key, value in _read_config(self, path).items() if key not in given
                       for a in _config_flag(self, key, value)]


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


def _read_config(parser: argparse.ArgumentParser, path: str) -> dict[str, object]:
    import yaml

    try:
        with open(path) as f:
            data = yaml.safe_load(f) or {}
    except (OSError, yaml.YAMLError) as e:
        parser.error(f"cannot read --config {path!r}: {e}")
    if not isinstance(data, dict):
        parser.error(f"--config {path!r} must hold a mapping of option names to values")
    return {"--" + str(k).replace("_", "-"): v for k, v in data.items()}


def _config_flag(parser: argparse.ArgumentParser, flag: str, value: object) -> list[str]:
    """The command-line form of one config entry."""
    import json

    action = parser._option_string_actions.get(flag)
    if action is None:
        parser.error(f"unrecognized option in the --config file: {flag[2:]!r}")
    if isinstance(value, bool):
        if isinstance(action, argparse.BooleanOptionalAction):
            return [flag if value else "--no-" + flag[2:]]
        return [flag] if value else []
    if isinstance(value, list):
        return [flag, *map(str, value)]
    return [flag, json.dumps(value) if isinstance(value, dict) else str(value)]


# subcommand -> module with `register(subparsers, parser_class, populate)`, in `vllm --help` order
SUBCOMMANDS = {
    "serve": "vllm.entrypoints.cli.serve",
    "chat": "vllm.entrypoints.cli.chat",
    "complete": "vllm.entrypoints.cli.complete",
    "run-batch": "vllm.entrypoints.cli.run_batch",
}


def make_parser(populate: Optional[Container[str]] = None) -> FlexibleArgumentParser:
    """The `vllm` parser; only the subcommands in `populate` (default: all) get their flags."""
    parser = FlexibleArgumentParser(prog="vllm", description="A compact LLM inference engine with vLLM's "
                                    "interface and first-class Activated LoRA (aLoRA).")
    parser.add_argument("-v", "--version", action="version", version=__version__)
    subparsers = parser.add_subparsers(dest="subcommand", metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        importlib.import_module(module).register(subparsers, FlexibleArgumentParser,
                                                 populate is None or name in populate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-v", "--version"):  # answer without importing the engine
        print(__version__)
        return
    # `vllm chat ...` needs only chat's flags; `vllm --help` needs none.
    parser = make_parser(populate={argv[0]} if argv and not argv[0].startswith("-") else set())
    args = parser.parse_args(argv)
    if not hasattr(args, "dispatch"):
        parser.print_help()
        sys.exit(1)
    args.dispatch(args)


if __name__ == "__main__":
    main()
