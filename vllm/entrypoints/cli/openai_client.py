"""What `vllm chat` and `vllm complete` share: their flags, the `openai` client, the model
they talk to, the read-a-line / print-the-streamed-answer session, and error reporting.

Both commands are clients of a running OpenAI-compatible server (ours or vLLM's); they
load no model. As in vLLM they print `Using model: NAME` first, then, interactively, a
greeting and a `> ` prompt before each line read from stdin, until EOF.

Invariants:
- Importing this module imports neither torch, the engine nor `openai` (the `vllm`
  parser imports it); `openai` is imported when a command runs.
- The answer goes to stdout exactly as streamed, then one newline; nothing else is
  printed between a prompt and its answer. Errors go to stderr as `vllm CMD: error: ...`.
- A connection failure ends the command (exit status 1) naming the URL. An error answer
  (4xx/5xx, or an error event in the stream) ends a `--quick` run with status 1; in an
  interactive session it is reported and the session goes on without that turn.
- Ctrl-C ends the command quietly with status 0 (as vLLM's client does).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Callable, Iterable, Optional

DEFAULT_URL = "http://localhost:8000/v1"


class SessionError(Exception):
    """An error answer from the server: reported, and fatal only for `--quick`."""


def add_client_args(parser: argparse.ArgumentParser, quick_metavar: str, quick_help: str) -> None:
    parser.add_argument("--url", default=DEFAULT_URL,
                        help=f"URL of the running OpenAI-compatible server's API (default: {DEFAULT_URL}).")
    parser.add_argument("--model-name", "--model", dest="model_name", default=None, metavar="NAME",
                        help="The model (or adapter) to ask; default: the first model /v1/models lists.")
    parser.add_argument("--api-key", default=None, metavar="KEY",
                        help="API key sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY, else none).")
    parser.add_argument("-q", "--quick", default=None, metavar=quick_metavar, help=quick_help)
    parser.add_argument("--max-tokens", type=int, default=None, metavar="N",
                        help="Most tokens per answer (default: the server's).")
    parser.add_argument("--temperature", type=float, default=None, metavar="T",
                        help="Sampling temperature, 0 for greedy (default: the server's).")


def sampling_kwargs(args: argparse.Namespace, max_tokens_field: str) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if args.max_tokens is not None:
        kwargs[max_tokens_field] = args.max_tokens
    if args.temperature is not None:
        kwargs["temperature"] = args.temperature
    return kwargs


def connect(args: argparse.Namespace):
    """(openai client, model name); prints `Using model: NAME` as vLLM does."""
    import openai

    api_key = args.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY"
    client = openai.OpenAI(base_url=args.url, api_key=api_key)
    model = args.model_name
    if not model:
        models = client.models.list().data
        if not models:
            raise SessionError(f"the server at {args.url} serves no model.")
        model = models[0].id
    print(f"Using model: {model}", flush=True)
    return client, model


def print_stream(chunks: Iterable[Any], text_of: Callable[[Any], Optional[str]]) -> str:
    """Print the first choice's text of each chunk as it arrives, then a newline; returns the text."""
    pieces: list[str] = []
    try:
        for chunk in chunks:
            piece = text_of(chunk.choices[0]) if chunk.choices else None
            if piece:
                pieces.append(piece)
                print(piece, end="", flush=True)
    finally:
        print(flush=True)
    return "".join(pieces)


def run_session(command: str, args: argparse.Namespace, greeting: str,
                make_ask: Callable[[Any, str], Callable[[str], Any]]) -> None:
    """Connect, then `--quick`: ask once; otherwise ask every stdin line until EOF.

    `make_ask(client, model)` returns the function that sends one line and prints the answer.
    Exits with status 1 on a connection failure, and on any error of a `--quick` run.
    """
    import openai

    try:
        ask = make_ask(*connect(args))
        if args.quick is not None:
            ask(args.quick)
            return
        print(greeting, flush=True)
        while True:
            try:
                line = input("> ")
            except EOFError:
                print(flush=True)
                return
            try:
                ask(line)
            except openai.APIConnectionError:
                raise
            except (openai.APIError, SessionError) as e:
                _report(command, _message(e))
    except openai.APIConnectionError as e:
        _report(command, f"could not connect to the OpenAI-compatible server at {args.url} ({e}). Start one "
                         "(`vllm serve MODEL`) or point --url at its /v1 address.")
    except (openai.APIError, SessionError) as e:
        _report(command, _message(e))
    except KeyboardInterrupt:
        print(flush=True)
        return
    sys.exit(1)


def _report(command: str, message: str) -> None:
    print(f"vllm {command}: error: {message}", file=sys.stderr, flush=True)


def _message(error: Exception) -> str:
    """The server's error message (from its OpenAI-shaped body) with the status, else the error's text."""
    import openai

    body = getattr(error, "body", None)
    message = body.get("message") if isinstance(body, dict) else None
    if isinstance(error, openai.APIStatusError):
        return f"{error.status_code} {message or error.message}"
    return str(message or error)
