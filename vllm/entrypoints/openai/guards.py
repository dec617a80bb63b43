"""Admission guards of the HTTP server: who may call a route, and how much they may send.

What it owns: two pure ASGI middlewares (never Starlette's BaseHTTPMiddleware, which runs
the app in another task and breaks streaming responses and disconnect detection):

- `APIKeyMiddleware`: with API keys set, every route needs `Authorization: Bearer KEY`
  except `OPEN_PATHS` (/health, /ping, /version, /metrics: probes and scrapers carry no
  key, as in vLLM). Unlike vLLM, which checks only /v1, the rest (/tokenize,
  /detokenize, /reset_prefix_cache, /docs, /redoc, /openapi.json, any route added later)
  needs the key too. CORS preflights (OPTIONS) pass: browsers send them without headers.
- `RequestBodyLimitMiddleware`: a request body longer than the limit is answered 413
  without reaching the app, whether it announces its length (Content-Length, refused
  before reading) or not (chunked, refused as soon as the bytes read pass the limit).

Invariants:
- Keys are compared in constant time against every key (no early exit), so timing does
  not tell which key nearly matched.
- A guard's refusal is an OpenAI-shaped JSON error; a 413 also closes the connection,
  since the rest of the body was never read.
- The body guard reads the body before the app runs and replays it as one message; later
  `receive()` calls go to the client, so disconnect detection is unchanged.
"""

from __future__ import annotations

import secrets

from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from vllm.entrypoints.openai.errors import error_response

OPEN_PATHS = frozenset({"/health", "/ping", "/version", "/metrics"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: list[str]):
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and scope["path"] not in OPEN_PATHS:
            given = Headers(scope=scope).get("authorization", "").encode()
            if not sum(secrets.compare_digest(given, key) for key in self.expected):
                await error_response("Unauthorized: send 'Authorization: Bearer <API key>' (the server was started "
                                     "with --api-key or VLLM_API_KEY).", 401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


class RequestBodyLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, int(declared))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending its body
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, None)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, declared: int | None) -> None:
        size = f"{declared} bytes" if declared is not None else "more than that"
        response = error_response(f"The request body is too large: {size}; the server accepts at most "
                                  f"{self.max_bytes} bytes (--max-request-body-bytes).", 413)
        response.headers["connection"] = "close"
        await response(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A `receive` that first hands out the whole body, then listens to the client."""
    pending: list[Message] = [{"type": "http.request", "body": body, "more_body": False}]

    async def replay() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replay
