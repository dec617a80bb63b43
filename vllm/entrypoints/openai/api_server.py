"""The OpenAI-compatible HTTP server: FastAPI routes over `AsyncLLM`, run by uvicorn.

What it owns: the routes (GET /health /ping /version /v1/models /metrics, POST
/v1/completions /v1/chat/completions /v1/responses, and /v1/load_lora_adapter /v1/unload_lora_adapter
when VLLM_ALLOW_RUNTIME_LORA_UPDATING is set, as in vLLM), API-key enforcement on /v1
routes, CORS, and the server's start-up and shutdown.

Invariants:
- Handlers only validate, submit and await: model steps run on the engine thread.
- A client that goes away aborts its request: a stream's generator is cancelled by
  Starlette, and a non-streaming handler is raced against the connection's
  `http.disconnect` (what vLLM's `with_cancellation` does).
- With API keys (`--api-key`, several allowed, or VLLM_API_KEY) every /v1 route needs
  `Authorization: Bearer <one of them>`; /health, /ping, /version and /metrics stay open.
- CORS headers are sent only when `--allowed-origins` is given (as in vLLM).
- Shutdown joins the engine thread.

`python -m vllm.entrypoints.openai.api_server` runs the same server with the same flags as
`vllm serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
from typing import Any, Awaitable, Optional

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm import envs
from vllm.engine.async_llm import AsyncLLM, EngineDeadError
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.cli_args import check_parser_flags, engine_args_from, make_arg_parser
from vllm.entrypoints.openai.errors import BadRequestError, ConflictError, error_response, install_error_handlers
from vllm.entrypoints.openai.metrics import ServerMetrics
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    parse_tokenize_request,
)
from vllm.entrypoints.openai.serving_chat import OpenAIServingChat
from vllm.entrypoints.openai.serving_completion import OpenAIServingCompletion
from vllm.entrypoints.openai.responses_protocol import ResponsesRequest
from vllm.entrypoints.openai.serving_models import OpenAIServingModels
from vllm.entrypoints.openai.serving_responses import OpenAIServingResponses
from vllm.entrypoints.openai.serving_tokenization import OpenAIServingTokenization
from vllm.entrypoints.openai.request_logger import RequestLogger
from vllm.logger import init_logger
from vllm.version import __version__

logger = init_logger(__name__)

router = APIRouter()
lora_router = APIRouter()


class APIKeyMiddleware:
    """Pure ASGI (not BaseHTTPMiddleware), so streaming and disconnects pass through untouched."""

    def __init__(self, app: ASGIApp, api_keys: list[str]):
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"].startswith("/v1"):
            given = Headers(scope=scope).get("authorization", "").encode()
            # Compare with every key (no early exit), so timing does not tell which key nearly matched.
            if not sum(secrets.compare_digest(given, key) for key in self.expected):
                await error_response("Unauthorized", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _until_disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(request: Request, work: Awaitable[Any]) -> Any:
    """Run `work`; if the client disconnects first, cancel it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():  # cancel() takes effect at the task's next step
        return Response(status_code=499)  # nobody is listening any more
    return task.result()


def _respond(result: Any) -> Response:
    if isinstance(result, Response):
        return result
    if isinstance(result, BaseModel):
        return JSONResponse(result.model_dump())
    return StreamingResponse(result, media_type="text/event-stream")


def _health(request: Request) -> Response:
    try:
        request.app.state.engine.check_health()
    except EngineDeadError:
        return Response(status_code=503)
    return Response(status_code=200)


@router.get("/health")
async def health(raw_request: Request) -> Response:
    return _health(raw_request)


@router.api_route("/ping", methods=["GET", "POST"])
async def ping(raw_request: Request) -> Response:
    return _health(raw_request)


@router.get("/version")
async def show_version() -> JSONResponse:
    return JSONResponse({"version": __version__})


@router.get("/v1/models")
async def show_available_models(raw_request: Request) -> JSONResponse:
    return JSONResponse(raw_request.app.state.models.show_available_models().model_dump())


@router.get("/metrics")
async def metrics(raw_request: Request) -> Response:
    return Response(raw_request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def _generate(raw_request: Request, work: Awaitable[Any], stream: bool) -> Response:
    """A generation endpoint's answer: a stream as it is, a whole response raced against
    the client's disconnect (which aborts its requests)."""
    return _respond(await work if stream else await _unless_disconnected(raw_request, work))


@router.post("/v1/completions")
async def create_completion(request: CompletionRequest, raw_request: Request) -> Response:
    serving: OpenAIServingCompletion = raw_request.app.state.serving_completion
    return await _generate(raw_request, serving.create_completion(request), request.stream)


@router.post("/v1/chat/completions")
async def create_chat_completion(request: ChatCompletionRequest, raw_request: Request) -> Response:
    serving: OpenAIServingChat = raw_request.app.state.serving_chat
    return await _generate(raw_request, serving.create_chat_completion(request), request.stream)


@router.post("/v1/responses")
async def create_response(request: ResponsesRequest, raw_request: Request) -> Response:
    serving: OpenAIServingResponses = raw_request.app.state.serving_responses
    return await _generate(raw_request, serving.create_response(request), request.stream)


@router.post("/tokenize")
async def tokenize(raw_request: Request) -> JSONResponse:
    request = parse_tokenize_request(await _json_body(raw_request))
    return JSONResponse(raw_request.app.state.serving_tokenization.tokenize(request))


@router.post("/detokenize")
async def detokenize(request: DetokenizeRequest, raw_request: Request) -> JSONResponse:
    return JSONResponse(raw_request.app.state.serving_tokenization.detokenize(request))


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(raw_request: Request) -> Response:
    """Forget every cached KV block (vLLM's route); 409 while requests hold blocks."""
    if not await raw_request.app.state.engine.reset_prefix_cache():
        raise ConflictError("The prefix cache can only be reset while no request is running.")
    return Response(status_code=200)


async def _json_body(raw_request: Request) -> Any:
    try:
        return await raw_request.json()
    except ValueError as e:
        raise BadRequestError(f"The request body is not valid JSON: {e}") from e


@lora_router.post("/v1/load_lora_adapter")
async def load_lora_adapter(request: LoadLoRAAdapterRequest, raw_request: Request) -> Response:
    return PlainTextResponse(await raw_request.app.state.models.load_lora_adapter(request))


@lora_router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(request: UnloadLoRAAdapterRequest, raw_request: Request) -> Response:
    return PlainTextResponse(await raw_request.app.state.models.unload_lora_adapter(request))


def build_app(args: argparse.Namespace, engine: AsyncLLM, models: OpenAIServingModels, metrics: ServerMetrics,
              api_keys: list[str], chat_template: Optional[str]) -> FastAPI:
    app = FastAPI(title="vllm", version=__version__, root_path=args.root_path or "")
    app.include_router(router)
    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        logger.warning("Runtime LoRA updating is enabled (VLLM_ALLOW_RUNTIME_LORA_UPDATING): do not use this "
                       "in production.")
        app.include_router(lora_router)
    install_error_handlers(app)
    if args.allowed_origins is not None:
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                           allow_credentials=args.allow_credentials, allow_methods=args.allowed_methods,
                           allow_headers=args.allowed_headers)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    app.state.engine = engine
    app.state.models = models
    app.state.metrics = metrics
    log = RequestLogger(args.max_log_len) if args.enable_log_requests else None
    app.state.serving_completion = OpenAIServingCompletion(engine, models, request_logger=log)
    app.state.serving_chat = OpenAIServingChat(
        engine, models, chat_template, args.response_role, request_logger=log,
        tool_parser=args.tool_call_parser if args.enable_auto_tool_choice else None,
        reasoning_parser=args.reasoning_parser)
    app.state.serving_tokenization = OpenAIServingTokenization(app.state.serving_chat)
    app.state.serving_responses = OpenAIServingResponses(app.state.serving_chat)
    return app


async def run_server(args: argparse.Namespace) -> None:
    check_parser_flags(args)  # fail before loading the model
    engine_args = engine_args_from(args)
    api_keys = list(args.api_key or ([envs.VLLM_API_KEY] if envs.VLLM_API_KEY else []))
    chat_template = load_chat_template(args.chat_template)  # fail before loading the model
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both to serve HTTPS.")
    served_names = engine_args.served_model_names()
    served_name = served_names[0]
    metrics = ServerMetrics(served_name)
    engine = AsyncLLM.from_engine_args(engine_args, observer=metrics)
    try:
        metrics.attach(engine.get_stats)
        models = OpenAIServingModels(engine, served_names, engine.model_config.model_dir,
                                     engine.model_config.max_model_len, args.lora_modules)
        await models.init_static_loras()
        app = build_app(args, engine, models, metrics, api_keys, chat_template)
        if chat_template is None and not getattr(engine.tokenizer, "chat_template", None):
            logger.warning("The tokenizer has no chat template: /v1/chat/completions needs --chat-template.")
        host = args.host or "0.0.0.0"
        logger.info("Serving model %r from %s (max_model_len=%d)", served_name, engine.model_config.model_dir,
                    engine.model_config.max_model_len)
        for line in await models.describe_adapters():
            logger.info("Serving adapter %s", line)
        scheme = "https" if args.ssl_certfile else "http"
        logger.info("Listening on %s://%s:%d%s", scheme, host, args.port,
                    " (API key required on /v1 routes)" if api_keys else "")
        config = uvicorn.Config(app, host=host, port=args.port, log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log, ssl_keyfile=args.ssl_keyfile,
                                ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                                ssl_cert_reqs=args.ssl_cert_reqs)
        await uvicorn.Server(config).serve()
    finally:
        engine.shutdown()


def main() -> None:
    """`python -m vllm.entrypoints.openai.api_server [--model MODEL] [flags]`: the same server as `vllm serve`."""
    from vllm.entrypoints.cli.main import FlexibleArgumentParser
    from vllm.entrypoints.cli.serve import DESCRIPTION, run

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m vllm.entrypoints.openai.api_server",
                                                    description=DESCRIPTION))
    run(parser.parse_args())


if __name__ == "__main__":
    main()
