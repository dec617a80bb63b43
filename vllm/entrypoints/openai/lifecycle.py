"""How the HTTP server stops: graceful drain on a signal, prompt exit when the engine dies.

What it owns: `DrainState` (is the server draining, how many HTTP requests are in flight),
`DrainMiddleware` (counts requests, refuses new ones while draining) and `GracefulServer`
(uvicorn's server with our signal handling and an engine watcher).

Invariants:
- The first SIGTERM or SIGINT starts a drain: the listening socket stays open so that
  every new request, on any route (/health and /ping included, so load balancers take
  the instance out), is answered 503 with `Retry-After` and an OpenAI-shaped body rather
  than refused by the kernel. Requests already in flight, streams included, run on for up
  to `--shutdown-timeout` seconds; those still running then are aborted by shutting the
  engine down, which fails each one through its route's own error path (a 503 JSON error,
  or an error event that ends a stream), so no client sees a silent cut. Then uvicorn
  stops and the process exits 0.
- A second SIGTERM/SIGINT exits at once with status 128 + signal number.
- uvicorn's own handler is replaced, not wrapped: it would close the listening socket at
  once and re-raise the signal after shutdown (exit status -15 instead of 0).
- When the engine dies on its own (`AsyncLLM.is_dead`), AsyncLLM has already failed every
  request in flight; the server drains for at most `ENGINE_DEATH_GRACE_S` so those errors
  reach their clients, then stops, and `engine_died` tells the caller to exit non-zero.
"""

from __future__ import annotations

import asyncio
import math
import os
import signal
import time
from types import FrameType
from typing import Optional

import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from vllm.engine.async_llm import AsyncLLM, EngineDeadError
from vllm.entrypoints.openai.errors import error_response
from vllm.logger import init_logger

logger = init_logger(__name__)

# How long failed requests get to send their errors once the engine is gone (they only
# write a few bytes; this bounds a client that does not read them).
ENGINE_DEATH_GRACE_S = 2.0
# How long aborted requests get to end once the engine is told to stop: the engine thread
# first finishes the step it is in, which under heavy load on a small CPU takes seconds.
ABORT_GRACE_S = 30.0
ENGINE_POLL_S = 0.1


class DrainState:
    """What the middleware and the server share: the drain deadline and the in-flight count."""

    def __init__(self) -> None:
        self.in_flight = 0
        self.idle = asyncio.Event()
        self.idle.set()
        self.deadline: Optional[float] = None  # monotonic time the drain ends; None while serving

    @property
    def draining(self) -> bool:
        return self.deadline is not None

    def retry_after(self) -> int:
        """Seconds a client should wait: this process refuses work at least until the drain ends."""
        left = (self.deadline or 0.0) - time.monotonic()
        return max(1, math.ceil(left))

    def started(self) -> None:
        self.in_flight += 1
        self.idle.clear()

    def finished(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self.idle.set()


class DrainMiddleware:
    """Pure ASGI, outermost: counts every HTTP request and refuses new ones while draining."""

    def __init__(self, app: ASGIApp, state: DrainState):
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.state.draining:
            response = error_response("The server is shutting down and accepts no new requests; retry on "
                                      "another instance.", 503)
            response.headers["retry-after"] = str(self.state.retry_after())
            response.headers["connection"] = "close"
            await response(scope, receive, send)
            return
        self.state.started()
        try:
            await self.app(scope, receive, send)
        finally:
            self.state.finished()


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: DrainState, engine: AsyncLLM, shutdown_timeout: float):
        super().__init__(config)
        self.state = state
        self.engine = engine
        self.shutdown_timeout = shutdown_timeout
        self.engine_died = False
        self._stopping_engine = False  # we shut the engine down: that is not a death
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # set by serve(), before the handler is installed
        self._tasks: list[asyncio.Task] = []

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        self._tasks.append(asyncio.create_task(self._watch_engine()))
        try:
            await super().serve(sockets)
        finally:
            for task in self._tasks:
                task.cancel()

    def handle_exit(self, sig: int, frame: Optional[FrameType]) -> None:
        """Signal handler (main thread): the first signal drains, a second one exits now."""
        name = signal.Signals(sig).name
        if self.state.draining or self.should_exit:
            logger.warning("Second %s while shutting down: exiting now.", name)
            os._exit(128 + sig)
        logger.info("%s received: refusing new requests, waiting up to %gs for %d in flight (--shutdown-timeout).",
                    name, self.shutdown_timeout, self.state.in_flight)
        self.state.deadline = time.monotonic() + self.shutdown_timeout
        # A signal handler may interrupt the loop anywhere: hand the drain to it, do not run it here.
        self._loop.call_soon_threadsafe(self._start, self._drain())

    def _start(self, work) -> None:
        self._tasks.append(asyncio.ensure_future(work))

    async def _drain(self) -> None:
        if not await _wait(self.state.idle, self.shutdown_timeout):
            logger.warning("Aborting %d request(s) still in flight after --shutdown-timeout %gs.",
                           self.state.in_flight, self.shutdown_timeout)
            self._stopping_engine = True
            # Fails every engine request and command through AsyncLLM, so each handler answers
            # its client with an error; join(0): the engine thread finishes its step on its own.
            self.engine.shutdown(timeout=0)
            if not await _wait(self.state.idle, ABORT_GRACE_S):
                logger.error("%d request(s) did not end after the engine stopped; uvicorn cancels them.",
                             self.state.in_flight)
        self.should_exit = True

    async def _watch_engine(self) -> None:
        while not self.engine.is_dead or self._stopping_engine:
            await asyncio.sleep(ENGINE_POLL_S)
        reason = "no reason given"
        try:
            self.engine.check_health()
        except EngineDeadError as e:
            reason = str(e)
        logger.error("The engine died (%s): failing requests in flight and exiting.", reason)
        self.engine_died = True
        if not self.state.draining:
            self.state.deadline = time.monotonic() + ENGINE_DEATH_GRACE_S
        await _wait(self.state.idle, ENGINE_DEATH_GRACE_S)
        self.should_exit = True


async def _wait(event: asyncio.Event, timeout: float) -> bool:
    """True if `event` was set within `timeout` seconds."""
    if event.is_set():  # wait_for with a timeout of 0 would not even look
        return True
    try:
        await asyncio.wait_for(event.wait(), timeout)
    except asyncio.TimeoutError:
        return False
    return True
