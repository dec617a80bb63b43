"""The OpenAI-compatible HTTP server: FastAPI routes over `AsyncLLM`, run by uvicorn.

What it owns: the routes (GET /health /ping /version /v1/models /metrics /get_load, POST
/v1/completions /v1/chat/completions /v1/responses /tokenize /detokenize
/reset_prefix_cache, and /v1/load_lora_adapter /v1/unload_lora_adapter when
VLLM_ALLOW_RUNTIME_LORA_UPDATING is set, as in vLLM), the middleware stack, CORS, and the
server's start-up and shutdown.

Invariants:
- Handlers only validate, submit and await: model steps run on the engine thread.
- A client that goes away aborts its request: a stream's generator is cancelled by
  Starlette, and a non-streaming handler is raced against the connection's
  `http.disconnect` (what vLLM's `with_cancellation` does).
- Middleware, outermost first: drain (`lifecycle`: 503 + Retry-After for every new request
  once a SIGTERM/SIGINT arrived), API key (`guards`: with `--api-key` or VLLM_API_KEY every
  route needs `Authorization: Bearer <key>` except /health, /ping, /version and /metrics;
  /docs, /redoc and /openapi.json included, `--disable-fastapi-docs` removes them), body
  limit (`guards`: 413 above `--max-request-body-bytes`, 32 MiB by default), CORS (only when
  `--allowed-origins` is given, as in vLLM).
- Runtime adapter loads read only under `--allowed-lora-root` (see `serving_models`).
- Shutdown: on a signal, requests in flight may finish for `--shutdown-timeout` seconds
  (default 0, as in vLLM), then are aborted with an error; the process exits 0. When the
  engine dies, the server fails what is in flight and exits 1 within seconds. Either way
  the engine thread is joined (bounded by `ENGINE_JOIN_TIMEOUT_S`).

`python -m vllm.entrypoints.openai.api_server` runs the same server with the same flags as
`vllm serve`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from typing import Any, Awaitable, Optional

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel

from vllm import envs
from vllm.engine.async_llm import AsyncLLM, EngineDeadError
from vllm.entrypoints.chat_utils import load_chat_template
from vllm.entrypoints.openai.cli_args import check_parser_flags, engine_args_from, make_arg_parser
from vllm.entrypoints.openai.errors import BadRequestError, ConflictError, OpenAIRoute, install_error_handlers
from vllm.entrypoints.openai.guards import APIKeyMiddleware, RequestBodyLimitMiddleware
from vllm.entrypoints.openai.lifecycle import ABORT_GRACE_S, DrainMiddleware, DrainState, GracefulServer
from vllm.entrypoints.openai.metrics import ServerMetrics
from vllm.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    parse_tokenize_request,
    tokenize_openapi,
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

router = APIRouter(route_class=OpenAIRoute)
lora_router = APIRouter(route_class=OpenAIRoute)

# The engine thread finishes its current step before it stops; a step never takes this long
# unless it hangs, and then the (daemon) thread is left behind rather than hanging the exit.
ENGINE_JOIN_TIMEOUT_S = 30.0


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


@router.get("/get_load")
async def get_load(raw_request: Request) -> JSONResponse:
    """The engine's load for vllm-router's `power_of_two` policy, which polls this route (SGLang's
    name) and reads the integer `load`: here running + waiting requests. The other fields are
    for people: the two counts, and the KV tokens that requests hold."""
    engine: AsyncLLM = raw_request.app.state.engine
    stats = engine.get_stats()
    block_size = engine.engine.vllm_config.cache_config.block_size
    held_tokens = round(stats.kv_cache_usage * stats.num_blocks) * block_size
    return JSONResponse({"load": stats.num_running + stats.num_waiting, "num_reqs": stats.num_running,
                         "num_waiting_reqs": stats.num_waiting, "num_tokens": held_tokens})


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


@router.post("/tokenize", openapi_extra=tokenize_openapi())
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


def create_app(args: argparse.Namespace, api_keys: list[str], drain: DrainState) -> FastAPI:
    """The routes and middleware, without the engine (`build_app` attaches it)."""
    docs = {} if not args.disable_fastapi_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="vllm", version=__version__, root_path=args.root_path or "", **docs)
    app.include_router(router)
    if envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        logger.warning("Runtime LoRA updating is enabled (VLLM_ALLOW_RUNTIME_LORA_UPDATING): do not use this "
                       "in production.")
        app.include_router(lora_router)
    install_error_handlers(app)
    # add_middleware puts each one outside the ones added before it.
    if args.allowed_origins is not None:
        app.add_middleware(CORSMiddleware, allow_origins=args.allowed_origins,
                           allow_credentials=args.allow_credentials, allow_methods=args.allowed_methods,
                           allow_headers=args.allowed_headers)
    app.add_middleware(RequestBodyLimitMiddleware, max_bytes=args.max_request_body_bytes)
    if api_keys:
        app.add_middleware(APIKeyMiddleware, api_keys=api_keys)
    app.add_middleware(DrainMiddleware, state=drain)
    return app


def build_app(args: argparse.Namespace, engine: AsyncLLM, models: OpenAIServingModels, metrics: ServerMetrics,
              api_keys: list[str], chat_template: Optional[str], drain: DrainState) -> FastAPI:
    app = create_app(args, api_keys, drain)
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


def _allowed_lora_root(args: argparse.Namespace) -> Optional[str]:
    """The real path of --allowed-lora-root (ValueError unless it is an existing folder)."""
    if args.allowed_lora_root is None:
        return None
    root = os.path.realpath(args.allowed_lora_root)
    if not os.path.isdir(root):
        raise ValueError(f"--allowed-lora-root {args.allowed_lora_root!r} is not an existing folder.")
    if not envs.VLLM_ALLOW_RUNTIME_LORA_UPDATING:
        logger.warning("--allowed-lora-root has no effect: runtime adapter loading needs "
                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True.")
    return root


async def run_server(args: argparse.Namespace) -> None:
    check_parser_flags(args)  # fail before loading the model
    engine_args = engine_args_from(args)
    api_keys = list(args.api_key or ([envs.VLLM_API_KEY] if envs.VLLM_API_KEY else []))
    chat_template = load_chat_template(args.chat_template)  # fail before loading the model
    lora_root = _allowed_lora_root(args)
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        raise ValueError("--ssl-keyfile and --ssl-certfile go together: give both to serve HTTPS.")
    served_names = engine_args.served_model_names()
    served_name = served_names[0]
    metrics = ServerMetrics(served_name)
    engine = AsyncLLM.from_engine_args(engine_args, observer=metrics)
    try:
        metrics.attach(engine.get_stats)
        models = OpenAIServingModels(engine, served_names, engine.model_config.model_dir,
                                     engine.model_config.max_model_len, args.lora_modules,
                                     allowed_lora_root=lora_root)
        await models.init_static_loras()
        drain = DrainState()
        app = build_app(args, engine, models, metrics, api_keys, chat_template, drain)
        if chat_template is None and not getattr(engine.tokenizer, "chat_template", None):
            logger.warning("The tokenizer has no chat template: /v1/chat/completions needs --chat-template.")
        host = args.host or "0.0.0.0"
        logger.info("Serving model %r from %s (max_model_len=%d)", served_name, engine.model_config.model_dir,
                    engine.model_config.max_model_len)
        for line in await models.describe_adapters():
            logger.info("Serving adapter %s", line)
        scheme = "https" if args.ssl_certfile else "http"
        logger.info("Listening on %s://%s:%d%s", scheme, host, args.port,
                    " (API key required)" if api_keys else "")
        config = uvicorn.Config(app, host=host, port=args.port, log_level=args.uvicorn_log_level,
                                access_log=not args.disable_uvicorn_access_log, ssl_keyfile=args.ssl_keyfile,
                                ssl_certfile=args.ssl_certfile, ssl_ca_certs=args.ssl_ca_certs,
                                ssl_cert_reqs=args.ssl_cert_reqs, timeout_graceful_shutdown=ABORT_GRACE_S)
        server = GracefulServer(config, drain, engine, args.shutdown_timeout)
        await server.serve()
    finally:
        engine.shutdown(timeout=ENGINE_JOIN_TIMEOUT_S)
    if server.engine_died:
        raise SystemExit("vllm serve: error: the engine died; the server stopped (see the log above).")


def main() -> None:
    """`python -m vllm.entrypoints.openai.api_server [--model MODEL] [flags]`: the same server as `vllm serve`."""
    from vllm.entrypoints.cli.main import FlexibleArgumentParser
    from vllm.entrypoints.cli.serve import DESCRIPTION, run

    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m vllm.entrypoints.openai.api_server",
                                                    description=DESCRIPTION))
    run(parser.parse_args())


if __name__ == "__main__":
    main()
