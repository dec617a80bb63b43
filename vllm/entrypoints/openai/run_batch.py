"""`vllm run-batch`: an OpenAI batch file through an in-process engine, no HTTP server.

What it owns: the batch flags, reading the input file, running every line through the
server's own request models and serving classes (`OpenAIServingChat`,
`OpenAIServingCompletion` over `OpenAIServingModels` and `AsyncLLM`, built as `vllm serve`
builds them, `--lora-modules` included), and writing the output file.

Input lines: `{"custom_id", "method": "POST", "url", "body"}` with `url`
`/v1/chat/completions`, `/v1/completions` or (where this build has
`serving_responses`) `/v1/responses`; blank lines are skipped. Output lines:
`{"id": "vllm-...", "custom_id", "response": {"status_code", "request_id": "vllm-batch-...",
"body"}, "error"}`, where `body` is what the server would answer (200) and `error` is null;
for a failed line `body` is null and `error` is the server's error body
`{"error": {"message", "type", "param", "code"}}` with `code` = `status_code`.

Invariants:
- One output line per input request, in input order, whatever order they finish in; an
  empty input gives an empty output. Output is written as soon as every earlier line is done.
- A bad line (not JSON, no `custom_id`, unknown `url`, a method other than POST, a body
  the server would refuse, `stream: true`, an engine ValueError) fails that line only,
  with the status the server would answer (400 for anything the line controls, 404 for an
  unknown model); the batch goes on and the command exits 0.
- Requests run concurrently (at most `2 * max_num_seqs` in flight), so they batch in the
  engine; greedy answers are the server's.
- `-i`/`-o` are local paths; a URL is refused before the model is loaded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable, Iterator, Optional, TextIO

from pydantic import BaseModel, ValidationError

from vllm.engine.arg_utils import EngineArgs
from vllm.entrypoints.openai.cli_args import _LoRAModulesAction
from vllm.entrypoints.openai.errors import BadRequestError, classify, error_body
from vllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from vllm.entrypoints.openai.response_models import random_id
from vllm.logger import init_logger

logger = init_logger(__name__)

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def make_arg_parser(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The batch flags (vLLM's names), then every engine flag as `vllm serve` has them."""
    from vllm.entrypoints.openai.tool_parsers import TOOL_PARSERS
    from vllm.reasoning import supported_reasoning_parsers

    parser.add_argument("-i", "--input-file", required=True, metavar="INPUT.jsonl",
                        help="The batch input file (a local path), one request per line.")
    parser.add_argument("-o", "--output-file", required=True, metavar="OUTPUT.jsonl",
                        help="Where to write one result per request, in input order (a local path).")
    parser.add_argument("--model", default=None,
                        help=f"The model: a local folder or hub id (default: {EngineArgs.model}).")
    parser.add_argument("--config", default=None, metavar="FILE.yaml",
                        help="A YAML file of option names and values; options on the command line win.")
    batch = parser.add_argument_group("batch")
    batch.add_argument("--lora-modules", nargs="+", action=_LoRAModulesAction, default=[], metavar="MODULE",
                       help="Adapters requests may name as `model`: name=path, or JSON "
                            '\'{"name": ..., "path": ..., "base_model_name": ...}\'. Several allowed.')
    batch.add_argument("--chat-template", default=None,
                       help="Chat template (a file or the Jinja text) replacing the tokenizer's.")
    batch.add_argument("--response-role", default="assistant", help="Role of generated chat messages.")
    batch.add_argument("--enable-log-requests", action="store_true", help="Log every request.")
    batch.add_argument("--disable-log-requests", action="store_true", help="Accepted for vLLM compatibility.")
    batch.add_argument("--max-log-len", type=int, default=None,
                       help="Most prompt characters and token ids a request log line shows (default: all).")
    batch.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="Parse tool calls out of chat answers; needs --tool-call-parser.")
    batch.add_argument("--tool-call-parser", default=None, metavar="NAME",
                       help="How tool calls are written by the model: " + ", ".join(sorted(TOOL_PARSERS)) + ".")
    batch.add_argument("--reasoning-parser", default=None, metavar="NAME",
                       help="Split reasoning from the answer: " + ", ".join(supported_reasoning_parsers()) + ".")
    batch.add_argument("--enable-prompt-tokens-details", action="store_true",
                       help="Accepted for vLLM compatibility: usage.prompt_tokens_details is always reported.")
    EngineArgs.add_cli_args(parser.add_argument_group("engine"))
    return parser


def check_local_paths(args: argparse.Namespace) -> None:
    for flag, path in (("--input-file", args.input_file), ("--output-file", args.output_file)):
        if _URL.match(path):
            raise ValueError(f"{flag} {path!r} is a URL; only local paths are supported (download or upload "
                             "the file separately).")
    if os.path.realpath(args.input_file) == os.path.realpath(args.output_file):
        raise ValueError("--output-file must differ from --input-file (it is written while the input is read).")


def result_line(custom_id: Optional[str], status: int, body: Any = None, error: Any = None) -> dict[str, Any]:
    return {"id": random_id("vllm"), "custom_id": custom_id,
            "response": {"status_code": status, "request_id": random_id("vllm-batch"), "body": body},
            "error": error}


def failure_line(custom_id: Optional[str], exc: BaseException) -> dict[str, Any]:
    status, message, param, err_type = classify(exc)
    if status >= 500:
        logger.error("Batch request %r failed: %s", custom_id, message, exc_info=exc)
    return result_line(custom_id, status, error=error_body(message, status, param, err_type))


def validation_error(exc: ValidationError) -> BadRequestError:
    """The 400 the server answers for a body that fails the request model."""
    from fastapi.exceptions import RequestValidationError

    from vllm.entrypoints.openai.errors import _validation_message

    message, param = _validation_message(RequestValidationError(exc.errors()))
    return BadRequestError(message, param=param)


@dataclass
class Endpoint:
    request_model: type[BaseModel]
    handle: Callable[[Any], Awaitable[Any]]


@dataclass
class BatchRunner:
    """Runs batch lines through `endpoints` (url -> request model and serving method)."""

    endpoints: dict[str, Endpoint]
    max_in_flight: int = 64
    failed: int = field(default=0, init=False)

    async def run_line(self, line: str, lineno: int = 0) -> dict[str, Any]:
        """The output object of input line number `lineno`; never raises (but for cancellation)."""
        custom_id = None
        try:
            try:
                item = json.loads(line)
            except json.JSONDecodeError as e:
                raise BadRequestError(f"Line {lineno} is not valid JSON: {e}") from e
            if not isinstance(item, dict):
                raise BadRequestError(f"Line {lineno} is not a JSON object with custom_id, method, url and body.")
            custom_id = item.get("custom_id")
            if not isinstance(custom_id, str):
                custom_id = None
                raise BadRequestError("custom_id must be a string.", param="custom_id")
            url = item.get("url")
            endpoint = self.endpoints.get(url)
            if endpoint is None:
                raise BadRequestError(f"URL {url} was used. Supported endpoints: {', '.join(self.endpoints)}.",
                                      param="url")
            method = item.get("method", "POST")
            if not isinstance(method, str) or method.upper() != "POST":
                raise BadRequestError(f"method must be POST, got {method!r}.", param="method")
            try:
                request = endpoint.request_model.model_validate(item.get("body"))
            except ValidationError as e:
                raise validation_error(e) from e
            if getattr(request, "stream", False):
                raise BadRequestError("Request must not be sent in stream mode", param="stream")
            response = await endpoint.handle(request)
            return result_line(custom_id, 200, body=response.model_dump())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure is this line's answer
            self.failed += 1
            return failure_line(custom_id, e)

    async def run(self, lines: Iterable[tuple[int, str]], out: TextIO, total: int = 0) -> int:
        """Run every (line number, line) concurrently; write results to `out` in input order.
        Returns the number of lines run."""
        slots = asyncio.Semaphore(self.max_in_flight)
        done: dict[int, dict[str, Any]] = {}
        written = 0
        started = time.monotonic()
        step = max(1, total // 10)

        async def one(index: int, lineno: int, line: str) -> None:
            nonlocal written
            try:
                done[index] = await self.run_line(line, lineno)
            finally:
                slots.release()
            while written in done:  # flush the finished prefix (one event loop: no lock needed)
                out.write(json.dumps(done.pop(written), ensure_ascii=False) + "\n")
                written += 1
                if written % step == 0 or written == total:
                    out.flush()
                    logger.info("Batch: %d/%d requests done (%.1fs)", written, total, time.monotonic() - started)

        tasks: set[asyncio.Task] = set()
        count = 0
        try:
            for count, (lineno, line) in enumerate(lines, start=1):
                await slots.acquire()
                task = asyncio.ensure_future(one(count - 1, lineno, line))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        out.flush()
        return count


def read_requests(path: str) -> Iterator[tuple[int, str]]:
    """(line number from 1, line) for every non-blank line of the input file."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if line.strip():
                yield lineno, line


def endpoints(chat: Any, completion: Any) -> dict[str, Endpoint]:
    """url -> Endpoint; /v1/responses too when this build serves it."""
    table = {
        "/v1/chat/completions": Endpoint(ChatCompletionRequest, chat.create_chat_completion),
        "/v1/completions": Endpoint(CompletionRequest, completion.create_completion),
    }
    try:
        from vllm.entrypoints.openai.responses_protocol import ResponsesRequest
        from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses
    except ModuleNotFoundError as e:
        if not (e.name or "").startswith("vllm.entrypoints.openai."):
            raise
        return table
    table["/v1/responses"] = Endpoint(ResponsesRequest, OpenAIServingResponses(chat).create_response)
    return table


async def run_batch(args: argparse.Namespace) -> None:
    from vllm.engine.async_llm import AsyncLLM
    from vllm.entrypoints.chat_utils import load_chat_template
    from vllm.entrypoints.openai.cli_args import check_parser_flags
    from vllm.entrypoints.openai.request_logger import RequestLogger
    from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
    from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
    from vllm.entrypoints.openai.serving_models import OpenAIServingModels

    # Everything a user can get wrong fails before the model loads.
    check_local_paths(args)
    check_parser_flags(args)
    chat_template = load_chat_template(args.chat_template)
    try:
        total = sum(1 for _ in read_requests(args.input_file))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --input-file {args.input_file!r}: {e}") from e
    args.model = args.model or EngineArgs.model
    engine_args = EngineArgs.from_cli_args(args)
    try:
        out = open(args.output_file, "w", encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot write --output-file {args.output_file!r}: {e}") from e
    with out:
        engine = AsyncLLM.from_engine_args(engine_args)
        try:
            models = OpenAIServingModels(engine, engine_args.served_model_names(), engine.model_config.model_dir,
                                         engine.model_config.max_model_len, args.lora_modules)
            await models.init_static_loras()
            for line in await models.describe_adapters():
                logger.info("Serving adapter %s", line)
            log = RequestLogger(args.max_log_len) if args.enable_log_requests else None
            chat = OpenAIServingChat(engine, models, chat_template, args.response_role, request_logger=log,
                                     tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
                                     reasoning_parser=args.reasoning_parser)
            completion = OpenAIServingCompletion(engine, models, request_logger=log)
            runner = BatchRunner(endpoints(chat, completion),
                                 max_in_flight=2 * engine.engine.vllm_config.scheduler_config.max_num_seqs)
            logger.info("Running %d batch requests from %s", total, args.input_file)
            started = time.monotonic()
            count = await runner.run(read_requests(args.input_file), out, total)
            logger.info("Wrote %d results (%d failed) to %s in %.1fs", count, runner.failed, args.output_file,
                        time.monotonic() - started)
        finally:
            engine.shutdown()


def run(args: argparse.Namespace, prog: str = "vllm run-batch") -> None:
    """Run the batch; a configuration error ends with a one-line message and status 1."""
    try:
        asyncio.run(run_batch(args))
    except ValueError as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        sys.exit(1)
    except KeyboardInterrupt:
        sys.exit(130)


def main() -> None:
    """`python -m vllm.entrypoints.openai.run_batch -i IN -o OUT [flags]`: the same as `vllm run-batch`."""
    from vllm.entrypoints.cli.main import FlexibleArgumentParser

    prog = "python -m vllm.entrypoints.openai.run_batch"
    parser = make_arg_parser(FlexibleArgumentParser(prog=prog, description="Run an OpenAI batch file."))
    run(parser.parse_args(), prog)


if __name__ == "__main__":
    main()
