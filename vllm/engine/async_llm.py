"""`AsyncLLM`: the asyncio front of the engine, used by the OpenAI-compatible server.

What it owns: one background thread that owns the `LLMEngine` and runs its step loop,
and the per-request streams that carry outputs back to the event loop.

Invariants:
- The event loop never runs a model step and never touches the engine: every command
  (add a request, abort, add or remove an adapter) travels to the engine thread through a
  thread-safe queue and its result (or exception, e.g. a processor ValueError) comes back
  to the awaiting coroutine through a future. Any other exception (a tokenizer or grammar
  compiler bug, a broken adapter file read) comes back as `EngineStepError` (HTTP 500) with
  the original as its cause: it fails that command only.
- Outputs reach a request's asyncio queue via `loop.call_soon_threadsafe`. A stream
  yields DELTA outputs (only what is new); `RequestStream.collect` rebuilds the whole
  output for callers that want it at once.
- A stream abandoned before it finished (client disconnect, cancelled task) aborts its
  request, so its KV blocks are freed.
- The engine thread blocks on the command queue when nothing is running (no busy spin).
- An exception in a step fails, with `EngineStepError`, the requests that step had
  scheduled (the scheduler's `last_output`; every in-flight request when the step broke
  before scheduling, so it is unknown what it touched) and aborts them; the others go on.
  The loop goes on if the engine is then consistent (every request it holds has a stream,
  every scheduled sequence a caller-side state, every KV block holder a request),
  otherwise the engine is marked dead and every later call raises `EngineDeadError`.
- A `BaseException` from a step (e.g. an injected fatal fault) is not recovered from: it
  ends the loop, which marks the engine dead and fails every stream and queued command.
- `tokenizer` may be used from the event loop for encode/decode while the engine thread
  decodes: both only read the HF tokenizer once its truncation/padding state is settled,
  which the constructor does before the thread starts.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from dataclasses import replace
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Protocol, Sequence

from vllm.engine.arg_utils import EngineArgs
from vllm.engine.core import EngineStats
from vllm.engine.llm_engine import LLMEngine
from vllm.inputs import PromptType
from vllm.logger import init_logger
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams

logger = init_logger(__name__)

_SHUTDOWN = object()
_ABORTED = object()


class EngineStepError(RuntimeError):
    """The engine failed on a request: a model step that ran it failed, or admitting it (or
    another command, e.g. loading an adapter) raised something other than a validation
    `ValueError`, i.e. a bug or a resource failure. Only the requests involved fail."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (shut down, or a failure left it unusable)."""


class RequestAbortedError(RuntimeError):
    """`collect` found its request aborted (by `AsyncLLM.abort`) before it produced output."""


class OutputObserver(Protocol):
    """Sees every step's outputs on the engine thread (metrics); must not raise."""

    def record(self, outputs: list[RequestOutput]) -> None: ...

    def record_abort(self, request_id: str) -> None: ...


class RequestStream:
    """Async iterator over one request's DELTA outputs; ends after the finished one."""

    def __init__(self, request_id: str, owner: "AsyncLLM"):
        self.request_id = request_id
        self.finished = False
        self._owner = owner
        self._queue: asyncio.Queue = asyncio.Queue()
        self._loop = asyncio.get_running_loop()

    def put_threadsafe(self, item: Any) -> None:
        _post(self._loop, self._queue.put_nowait, item)

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        item = await self._queue.get()
        if item is _ABORTED:
            self.finished = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def abort(self) -> None:
        """Abort the request unless it already finished (idempotent, non-blocking)."""
        if not self.finished:
            self.finished = True
            self._owner.abort_nowait(self.request_id)

    async def collect(self) -> RequestOutput:
        """Consume the stream and return the whole output (aborts if cancelled)."""
        merged: Optional[RequestOutput] = None
        try:
            async for delta in self:
                merged = delta if merged is None else _merge(merged, delta)
        finally:
            self.abort()
        if merged is None:
            raise RequestAbortedError(f"Request {self.request_id} was aborted before it produced output.")
        return merged


def _merge(acc: RequestOutput, delta: RequestOutput) -> RequestOutput:
    by_index = {c.index: c for c in acc.outputs}
    for c in delta.outputs:
        old = by_index.get(c.index)
        if old is None:
            by_index[c.index] = replace(c, token_ids=list(c.token_ids), token_texts=list(c.token_texts),
                                        logprobs=list(c.logprobs) if c.logprobs is not None else None)
            continue
        old.text += c.text
        old.token_ids.extend(c.token_ids)
        old.token_texts.extend(c.token_texts)
        if c.logprobs is not None:
            old.logprobs = (old.logprobs or []) + list(c.logprobs)
        old.cumulative_logprob = c.cumulative_logprob
        old.finish_reason, old.stop_reason = c.finish_reason, c.stop_reason
    return replace(
        delta,
        outputs=[by_index[i] for i in sorted(by_index)],
        prompt_logprobs=delta.prompt_logprobs or acc.prompt_logprobs,
    )


class AsyncLLM:
    def __init__(self, engine: LLMEngine, observer: Optional[OutputObserver] = None):
        self.engine = engine
        self.observer = observer
        self.tokenizer = engine.get_tokenizer()
        self.model_config = engine.model_config
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # owned by the engine thread
        self._stats: EngineStats = engine.get_stats()
        self._dead: Optional[BaseException] = None
        # A fast tokenizer's first encode may reset padding/truncation it was saved with (a
        # write); doing it here keeps every later call, from any thread, a read.
        self.tokenizer.encode("")
        engine.engine_core.add_failure_callback(self._on_fatal)
        self._thread = threading.Thread(target=self._run, name="vllm-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, observer: Optional[OutputObserver] = None) -> "AsyncLLM":
        return cls(LLMEngine.from_engine_args(engine_args, usage="server"), observer)

    # ------------------------------------------------------------ event-loop API
    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def check_health(self) -> None:
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))

    def get_stats(self) -> EngineStats:
        """The snapshot taken after the engine thread's latest iteration."""
        return self._stats

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        lora_request: Optional[LoRARequest] = None,
        *,
        priority: int = 0,
    ) -> RequestStream:
        """Validate and enqueue a request; ValueError if the processor rejects it (a
        non-zero `priority` needs the engine's scheduling_policy="priority")."""
        params = params.clone()
        params.output_kind = RequestOutputKind.DELTA
        stream = RequestStream(request_id, self)
        try:
            await self._call(self._add, request_id, prompt, params, lora_request, stream, priority)
        except asyncio.CancelledError:
            # The add may still run after we stop waiting: make sure it does not linger.
            stream.abort()
            raise
        return stream

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams,
        request_id: str,
        lora_request: Optional[LoRARequest] = None,
        *,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        stream = await self.add_request(request_id, prompt, sampling_params, lora_request, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        await self._call(self._abort, request_id)

    def abort_nowait(self, request_id: str) -> None:
        if self._dead is None:
            self._commands.put((self._abort, (request_id,), None, None))

    async def add_lora(self, lora_request: LoRARequest) -> None:
        await self._call(self.engine.add_lora, lora_request)

    async def remove_lora(self, lora_int_id: int) -> None:
        await self._call(self.engine.remove_lora, lora_int_id)

    async def reset_prefix_cache(self) -> bool:
        return await self._call(self.engine.reset_prefix_cache)

    async def is_alora(self, lora_request: LoRARequest) -> bool:
        return await self._call(self.engine.is_alora, lora_request)

    async def start_profile(self) -> None:
        """Profile the engine thread's steps (needs VLLM_TORCH_PROFILER_DIR)."""
        await self._call(self.engine.start_profile)

    async def stop_profile(self) -> str:
        return await self._call(self.engine.stop_profile)

    def shutdown(self, timeout: Optional[float] = None) -> None:
        if self._thread.is_alive():
            self._commands.put(_SHUTDOWN)
            self._thread.join(timeout)

    def _on_fatal(self, reason: str) -> None:
        """A part of the engine died outside a step (a tensor-parallel rank, on the watchdog's
        thread): wake the loop with a command that ends it, so the engine is marked dead even
        while idle."""
        self._commands.put((_raise_fatal, (reason,), None, None))

    async def _call(self, fn: Callable, *args: Any) -> Any:
        self.check_health()
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._commands.put((fn, args, future, loop))
        if self._dead is not None:  # the loop stopped between the check and the put
            self._drain_commands()
        return await future

    # ------------------------------------------------------------ engine thread
    def _add(self, request_id: str, prompt: PromptType, params: SamplingParams,
             lora_request: Optional[LoRARequest], stream: RequestStream, priority: int = 0) -> None:
        if request_id in self._streams:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        self.engine.add_request(request_id, prompt, params, lora_request=lora_request, priority=priority)
        self._streams[request_id] = stream

    def _abort(self, request_id: str) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is None:
            return
        self.engine.abort_request(request_id)
        stream.put_threadsafe(_ABORTED)
        if self.observer is not None:
            self.observer.record_abort(request_id)

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                # Sleep on the queue when idle; otherwise take what is there and step.
                commands = [self._commands.get()] if idle else []
                while True:
                    try:
                        commands.append(self._commands.get_nowait())
                    except queue.Empty:
                        break
                if any(c is _SHUTDOWN for c in commands):
                    self._stop(EngineDeadError("The engine was shut down."), commands)
                    return
                for command in commands:
                    self._execute(*command)
                if self.engine.has_unfinished_requests():
                    self._step()
                else:
                    self._stats = self.engine.get_stats()
        except BaseException as e:  # the loop itself broke: nothing can be served any more
            logger.exception("The engine loop stopped")
            self._stop(EngineDeadError(f"The engine loop stopped: {e!r}"))

    def _execute(self, fn: Callable, args: tuple, future: Optional[asyncio.Future],
                 loop: Optional[asyncio.AbstractEventLoop]) -> None:
        try:
            result = fn(*args)
        except Exception as e:
            if future is None:
                logger.exception("Engine command %s failed", getattr(fn, "__name__", fn))
            elif isinstance(e, ValueError):  # validation: the caller's mistake (HTTP 400)
                _post(loop, _settle, future, None, e)
            else:  # not the caller's mistake: a server error (HTTP 500) for this command only
                failure = EngineStepError(f"The engine failed on this request: {e!r}")
                failure.__cause__ = e
                _post(loop, _settle, future, None, failure)
            return
        if future is not None:
            _post(loop, _settle, future, result, None)

    def _step(self) -> None:
        before = self.engine.engine_core.scheduler.last_output
        try:
            outputs = self.engine.step()
        except Exception as e:
            self._recover_from_step_error(e, before)
            self._stats = self.engine.get_stats()
            return
        # Before any caller sees this step's outputs, so stats never lag what they saw.
        self._stats = self.engine.get_stats()
        for output in outputs:
            stream = self._streams.get(output.request_id)
            if stream is None:
                continue
            if output.finished:
                del self._streams[output.request_id]
            stream.put_threadsafe(output)
        if self.observer is not None:
            try:
                self.observer.record(outputs)
            except Exception:
                logger.exception("Recording metrics failed")

    def _recover_from_step_error(self, error: Exception, before: Any) -> None:
        """Fail and abort the requests the failed step scheduled. `before` is the scheduler's
        `last_output` from before the step: if it is still the latest, the step broke before
        scheduling anything, and what it touched is unknown."""
        scheduled = self.engine.engine_core.scheduler.last_output
        ids = list(self._streams) if scheduled is before else self._parents_of(scheduled.num_scheduled_tokens)
        logger.exception("Engine step failed; failing the %d request(s) it ran: %s", len(ids), ", ".join(ids))
        for request_id in ids:  # one exception each: a shared one would pile up tracebacks
            failure = EngineStepError(f"The engine failed while running this request: {error!r}")
            self._streams.pop(request_id).put_threadsafe(failure)
        try:
            self.engine.abort_request(ids)
            if scheduled is before:  # nothing is left running: drop cache entries the step may have made
                self.engine.reset_prefix_cache()
            problem = self._inconsistency()
            if problem:
                raise RuntimeError(problem)
        except Exception as e:
            # The engine's state is no longer trustworthy: stop serving rather than corrupt outputs.
            raise RuntimeError(f"engine unusable after a failed step ({error!r}): {e!r}") from e

    def _parents_of(self, child_ids: Iterable[str]) -> list[str]:
        """Stream ids (parent requests) of engine-core request ids (an `n > 1` child fails its parent)."""
        children = self.engine.output_processor.child_to_parent
        parents = {children[c][0].request_id for c in child_ids if c in children}
        return sorted(p for p in parents if p in self._streams)

    def _inconsistency(self) -> Optional[str]:
        """What is wrong with the engine's bookkeeping after a recovery, or None."""
        processor, scheduler = self.engine.output_processor, self.engine.engine_core.scheduler
        orphans = set(processor.parents) - set(self._streams)
        if orphans:
            return f"requests without a caller are still in the engine: {sorted(orphans)}"
        if not set(scheduler.requests) <= set(processor.child_to_parent):
            return "the scheduler holds sequences no caller waits for"
        if not set(scheduler.kv_cache_manager.req_to_blocks) <= set(scheduler.requests):
            return "KV blocks are held by requests the scheduler no longer knows"
        return None

    def _stop(self, error: EngineDeadError, taken: Sequence[Any] = ()) -> None:
        """Fail everything still waiting: streams, commands already taken from the queue, queued ones."""
        # Set before draining: a caller that enqueues after our drain sees it and drains itself.
        self._dead = error
        self._fail_streams(error)
        for command in taken:
            self._fail_command(command)
        self._drain_commands()
        self.engine.engine_core.shutdown()  # tensor-parallel workers, if any

    def _fail_streams(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put_threadsafe(error)
        self._streams.clear()

    def _drain_commands(self) -> None:
        """Fail commands nobody will run (safe from any thread once the loop is gone)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            self._fail_command(command)

    def _fail_command(self, command: Any) -> None:
        if command is not _SHUTDOWN and command[2] is not None:
            _post(command[3], _settle, command[2], None, EngineDeadError(str(self._dead)))


def _post(loop: asyncio.AbstractEventLoop, fn: Callable, *args: Any) -> None:
    """Run `fn(*args)` on `loop`; a closed loop has nobody left to tell."""
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass


def _raise_fatal(reason: str) -> None:
    from vllm.executor.multiproc import TensorParallelError

    raise TensorParallelError(reason)


def _settle(future: asyncio.Future, result: Any, error: Optional[BaseException]) -> None:
    if future.done():  # the caller stopped waiting (cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
