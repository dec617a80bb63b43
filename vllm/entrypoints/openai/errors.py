"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}`.

What it owns: the mapping from every failure a handler can meet to a status code and an
OpenAI/vLLM error type, and the FastAPI exception handlers that apply it.

Invariants:
- Anything the user controls (parameters, JSON, prompt length, unknown model, an aLoRA
  request without its invocation) answers 4xx. `ValueError` is what the engine's
  validation raises, so it maps to 400; FastAPI's 422 for schema errors becomes 400.
- Only engine failures answer 5xx (500 for a failed step, 503 once the engine is dead);
  they are logged with their traceback. No handler lets an exception stop the server.
- Routes use `OpenAIRoute`, which answers any exception of a handler itself: Starlette's
  handler for bare `Exception` would answer too but then re-raise, which closes the
  client's keep-alive connection and logs it as unhandled.
"""

from __future__ import annotations

from http import HTTPStatus
from typing import Any, Callable, Coroutine, Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.routing import APIRoute
from starlette.exceptions import HTTPException as StarletteHTTPException

from vllm.engine.async_llm import EngineDeadError, EngineStepError
from vllm.logger import init_logger

logger = init_logger(__name__)

# vLLM names the error type after the OpenAI SDK exception a status maps to.
_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    403: "PermissionDeniedError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    409: "ConflictError",
    413: "RequestTooLargeError",
    415: "UnsupportedMediaTypeError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}


class OpenAIServingError(Exception):
    """An error with a chosen status, raised by serving code and answered as JSON."""

    status: int = 400

    def __init__(self, message: str, status: Optional[int] = None, param: Optional[str] = None,
                 err_type: Optional[str] = None):
        super().__init__(message)
        self.message = message
        self.status = status or self.status
        self.param = param
        self.err_type = err_type


class BadRequestError(OpenAIServingError):
    status = 400


class NotFoundError(OpenAIServingError):
    status = 404


class ConflictError(OpenAIServingError):
    status = 409


def error_body(message: str, status: int, param: Optional[str] = None, err_type: Optional[str] = None) -> dict:
    return {
        "error": {
            "message": message,
            "type": err_type or _TYPES.get(status, HTTPStatus(status).phrase.replace(" ", "") + "Error"),
            "param": param,
            "code": status,
        }
    }


def error_response(message: str, status: int, param: Optional[str] = None,
                   err_type: Optional[str] = None) -> JSONResponse:
    return JSONResponse(error_body(message, status, param, err_type), status_code=status)


def classify(exc: BaseException) -> tuple[int, str, Optional[str], Optional[str]]:
    """(status, message, param, type) for an exception raised while serving a request."""
    if isinstance(exc, OpenAIServingError):
        return exc.status, exc.message, exc.param, exc.err_type
    if isinstance(exc, ValueError):
        return 400, str(exc), None, None
    if isinstance(exc, EngineDeadError):
        return 503, f"The engine is not running: {exc}", None, None
    if isinstance(exc, EngineStepError):
        return 500, str(exc), None, None
    return 500, f"Internal server error: {exc!r}", None, None


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    parts, param = [], None
    for error in exc.errors():
        loc = [str(p) for p in error.get("loc", ()) if p != "body"]
        if error.get("type") == "json_invalid":
            parts.append(f"Invalid JSON body: {error.get('ctx', {}).get('error', error.get('msg'))}")
            continue
        where = ".".join(loc)
        param = param or where or None
        # pydantic prefixes errors raised by our validators; the text after it is ours.
        msg = error.get("msg", "invalid value").removeprefix("Value error, ")
        parts.append(f"{where}: {msg}" if where else msg)
    return "; ".join(parts) or "Invalid request body.", param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_response(message, 400, param)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        detail: Any = exc.detail
        if isinstance(exc.__cause__, UnicodeDecodeError):  # FastAPI's "error parsing the body" says not why
            detail = f"The request body is not valid JSON: it must be UTF-8 ({exc.__cause__})."
        return error_response(detail if isinstance(detail, str) else str(detail), exc.status_code)

    # Specific classes are answered by Starlette's ExceptionMiddleware; a handler for
    # bare Exception (what escapes a route that is not an OpenAIRoute) also answers (500)
    # but Starlette re-raises it for the server's log.
    for cls in (OpenAIServingError, ValueError, EngineDeadError, EngineStepError, Exception):
        app.add_exception_handler(cls, _answer)


async def _answer(request: Request, exc: Exception) -> JSONResponse:
    status, message, param, err_type = classify(exc)
    if status >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, message, exc_info=exc)
    return error_response(message, status, param, err_type)


class OpenAIRoute(APIRoute):
    """A route whose handler's exceptions become OpenAI-shaped answers right here, so none
    reaches Starlette's server-error layer (FastAPI's own 4xx exceptions go on to their handlers)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def answered(request: Request) -> Response:
            try:
                return await handler(request)
            except (StarletteHTTPException, RequestValidationError):
                raise
            except Exception as exc:
                return await _answer(request, exc)

        return answered
