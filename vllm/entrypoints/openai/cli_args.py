"""The `vllm serve` flags: the server's own (frontend) flags plus every `EngineArgs` flag.

What it owns: flag names, defaults and parsing of frontend options (`--host`, `--port`,
`--api-key`, TLS, request logging, `--lora-modules`, `--chat-template`, CORS, uvicorn,
`--shutdown-timeout`, `--max-request-body-bytes`, `--allowed-lora-root`,
`--disable-fastapi-docs`), with vLLM's names where vLLM has the option.
Engine flags (including `--served-model-name`) come from `EngineArgs.add_cli_args`,
never duplicated here.

Invariants: `--lora-modules` accepts `name=path` and vLLM's JSON form, several values
per flag and repeated flags (they accumulate); a malformed value is an argparse error
(exit 2 with a message), not a traceback.
"""

from __future__ import annotations

import argparse
import json

from vllm.engine.arg_utils import EngineArgs, human_readable_int
from vllm.entrypoints.openai.serving_models import LoRAModulePath, parse_lora_module
from vllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
from vllm.reasoning import supported_reasoning_parsers

UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")
DEFAULT_MAX_REQUEST_BODY_BYTES = 32 * 2**20  # far above any text request; bounds what one client makes us buffer


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


def _non_negative_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from None
    if not seconds >= 0:  # also refuses nan
        raise argparse.ArgumentTypeError(f"expected 0 or more seconds, got {value!r}")
    return seconds


def _positive_size(value: str) -> int:
    size = human_readable_int(value)
    if size <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of bytes, got {value!r}")
    return size


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                        help=f"The model to serve: a local folder or hub id (default: {EngineArgs.model}).")
    parser.add_argument("--model", default=None, help="The model to serve (the positional MODEL wins).")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="A YAML file of option names and values (e.g. `max_model_len: 4096`); options given "
                             "on the command line win.")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default=None, help="Host to bind (default: all interfaces).")
    server.add_argument("--port", type=int, default=8000, help="Port to listen on.")
    server.add_argument("--api-key", nargs="+", default=None, metavar="KEY",
                        help="Require one of these keys (Authorization: Bearer KEY) on every route except "
                             "/health, /ping, /version and /metrics (the docs and /openapi.json included). "
                             "VLLM_API_KEY is used when the flag is not given.")
    server.add_argument("--ssl-keyfile", default=None, help="TLS private key file (serve HTTPS with --ssl-certfile).")
    server.add_argument("--ssl-certfile", default=None, help="TLS certificate file.")
    server.add_argument("--ssl-ca-certs", default=None, help="CA certificates file (to verify client certificates).")
    server.add_argument("--ssl-cert-reqs", type=int, default=0,
                        help="Whether a client certificate is required (Python ssl module's values: 0, 1, 2).")
    server.add_argument("--enable-log-requests", action="store_true",
                        help="Log every request: its id, prompt (up to --max-log-len characters and tokens), "
                             "sampling parameters and adapter.")
    server.add_argument("--disable-log-requests", action="store_true",
                        help="Accepted for vLLM compatibility (requests are not logged unless "
                             "--enable-log-requests is given).")
    server.add_argument("--max-log-len", type=int, default=None,
                        help="Most prompt characters and token ids a request log line shows (default: all).")
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
    server.add_argument("--allowed-origins", type=_json_list, default=None,
                        help="CORS origins (JSON list). CORS is off (no CORS headers) unless this is given.")
    server.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS methods (JSON list).")
    server.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS headers (JSON list).")
    server.add_argument("--allow-credentials", action="store_true", help="CORS: allow credentials.")
    server.add_argument("--root-path", default=None, help="ASGI root_path, when behind a path-based proxy.")
    server.add_argument("--disable-fastapi-docs", action="store_true",
                        help="Serve no /docs, /redoc or /openapi.json.")
    server.add_argument("--shutdown-timeout", type=_non_negative_seconds, default=0, metavar="SECONDS",
                        help="On SIGTERM or SIGINT, new requests get 503 while requests in flight (streams included) "
                             "may run this long; then those left are aborted with an error and the server exits 0. "
                             "0 (the default, as in vLLM) aborts them at once. A second signal exits at once.")
    server.add_argument("--max-request-body-bytes", type=_positive_size, default=DEFAULT_MAX_REQUEST_BODY_BYTES,
                        metavar="BYTES",
                        help="Largest request body accepted (413 above it, also for chunked bodies); "
                             "human-readable sizes such as 32M (MiB) or 1m (10^6) work. Default: 32M.")
    server.add_argument("--allowed-lora-root", default=None, metavar="DIR",
                        help="The folder runtime adapter loads (/v1/load_lora_adapter, with "
                             "VLLM_ALLOW_RUNTIME_LORA_UPDATING) may read from: an adapter path whose real path "
                             "(symlinks and '..' resolved) is not inside it is refused. Without it runtime loads "
                             "are refused; --lora-modules adapters are not restricted.")
    server.add_argument("--enable-auto-tool-choice", action="store_true",
                        help="Parse tool calls out of chat answers (tool_choice 'auto'); needs --tool-call-parser.")
    server.add_argument("--tool-call-parser", default=None, metavar="NAME",
                        help="How tool calls are written by the model: " + ", ".join(sorted(TOOL_PARSERS)) + ".")
    server.add_argument("--reasoning-parser", default=None, metavar="NAME",
                        help="Split reasoning from the answer (message.reasoning): "
                             + ", ".join(supported_reasoning_parsers()) + ".")
    server.add_argument("--enable-prompt-tokens-details", action="store_true",
                        help="Accepted for vLLM compatibility: usage.prompt_tokens_details (with cached_tokens) "
                             "is always reported.")
    engine = parser.add_argument_group("engine")
    EngineArgs.add_cli_args(engine)
    return parser


def check_parser_flags(args: argparse.Namespace) -> None:
    """Tool and reasoning parser flags must name known parsers and go together as in vLLM."""
    from vllm.entrypoints.openai.tool_parsers import get_tool_parser
    from vllm.reasoning import get_reasoning_parser

    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser.")
    if args.tool_call_parser:
        get_tool_parser(args.tool_call_parser)
    if args.reasoning_parser:
        get_reasoning_parser(args.reasoning_parser)


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    """EngineArgs of a parsed `vllm serve` command line (MODEL defaults to EngineArgs')."""
    args.model = args.model_tag or args.model or EngineArgs.model
    return EngineArgs.from_cli_args(args)
