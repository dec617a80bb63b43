"""The `vllm serve` flags: the server's own (frontend) flags plus every `EngineArgs` flag.

What it owns: flag names, defaults and parsing of frontend options (`--host`, `--port`,
`--api-key`, `--lora-modules`, `--chat-template`, CORS, uvicorn), with vLLM's names.
Engine flags (including `--served-model-name`) come from `EngineArgs.add_cli_args`,
never duplicated here.

Invariants: `--lora-modules` accepts `name=path` and vLLM's JSON form, several values
per flag and repeated flags (they accumulate); a malformed value is an argparse error
(exit 2 with a message), not a traceback.
"""

from __future__ import annotations

import argparse
import json

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.serving_models import LoRAModulePath, parse_lora_module

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


class _LoRAModulesAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        modules: list[LoRAModulePath] = list(getattr(namespace, self.dest, None) or [])
        for value in values:
            try:
                modules.append(parse_lora_module(value))
            except ValueError as e:
                parser.error(str(e))
        setattr(namespace, self.dest, modules)


def _json_list(value: str) -> list:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {value!r}") from e
    if not isinstance(parsed, list):
        raise argparse.ArgumentTypeError(f"expected a JSON list, got {value!r}")
    return parsed


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=f"The model to serve: a local folder or hub id (default: {EngineArgs.model}).")
    parser.add_argument("--model", default=None, help="The model to serve (the positional MODEL wins).")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=None, help="Host to bind (default: all interfaces).")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument("--api-key", default=None,
                        help="Require this key (Authorization: Bearer KEY) on every /v1 route. "
                             "VLLM_API_KEY is used when the flag is not given.")
    server.add_argument("--lora-modules", nargs="+", action=_LoRAModulesAction, default=[], metavar="MODULE",
                        help="Adapters to serve from start-up: name=path, or JSON "
                             '\'{"name": ..., "path": ..., "base_model_name": ...}\'. Several allowed.')
    server.add_argument("--chat-template", default=None,
                        help="Chat template (a file or the Jinja text) replacing the tokenizer's.")
    server.add_argument("--response-role", default="assistant",
                        help="Role of generated chat messages when add_generation_prompt is true.")
    server.add_argument("--uvicorn-log-level", default="info", choices=UVICORN_LOG_LEVELS,
                        help="Log level of uvicorn.")
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="Do not log every request.")
    server.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS origins (JSON list).")
    server.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods (JSON list).")
    server.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers (JSON list).")
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    server.add_argument("--root-path", default=None, help="ASGI root_path, when behind a path-based proxy.")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="Accepted for vLLM compatibility: usage.prompt_tokens_details (with cached_tokens) "
                             "is always reported.")
    engine = parser.add_argument_group("engine")
    EngineArgs.add_cli_args(engine)
    return parser


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs of a parsed `vllm serve` command line (MODEL defaults to EngineArgs')."""
    args.model = args.model_tag or args.model or EngineArgs.model
    return EngineArgs.from_cli_args(args)
