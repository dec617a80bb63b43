"""`MultiprocExecutor`: tensor parallelism over `tensor_parallel_size` ranks: rank 0's
`ModelRunner` in the engine process, one spawned worker process per other rank
(executor/worker_proc.py), torch.distributed between them (gloo on the CPU, NCCL on CUDA).

It offers the engine core the runner's surface (load_model, profile_peak_bytes,
initialize_kv_cache, execute_model, lora_manager, model), sending each call to every worker
before running it on rank 0: the scheduler runs only here, and each step's scheduler output
(new requests with their adapter weights, aLoRA starts and the rest) travels to the workers as
is (adapter weights once per adapter in use: executor/adapter_relay.py), so each rank builds
the same token-to-adapter mapping.

Invariants:
- Rank 0's samples are the step's; the workers receive them with the next step and overwrite
  their own (worker_proc.py).
- A failed step, a worker that exits or a collective that times out (a hung rank) raises
  `TensorParallelError`, a `BaseException`: the ranks can no longer be known to agree, so the
  engine stops (AsyncLLM marks itself dead, the server answers /health 503 and exits non-zero).
  A watchdog thread notices a worker that exits while the engine is idle and calls the
  registered failure callbacks.
- `shutdown` (also run at interpreter exit and when the executor is collected, e.g. after
  `del llm`) stops and joins
  every worker and leaves the process group: no orphan processes; the worker processes also
  die with the engine process if it is killed.
- CPU ranks each get their own thread pool: `--cpu-threads` threads each (default: the
  process's cores divided among the ranks), pinned to disjoint cores when
  VLLM_CPU_OMP_THREADS_BIND lists them ("0-3|4-7").
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import socket
import threading
import time
import weakref
from typing import Any, Callable, Optional

import torch

from vllm import envs
from vllm.config import VllmConfig
from vllm.core.sched_output import ModelRunnerOutput, SchedulerOutput
from vllm.distributed.parallel_state import DEFAULT_TIMEOUT_S, destroy_tensor_parallel, init_tensor_parallel
from vllm.executor.adapter_relay import AdapterRelay
from vllm.executor.worker_proc import receive, run_worker, send
from vllm.logger import init_logger
from vllm.worker.model_runner import ModelRunner

logger = init_logger(__name__)

_WATCH_INTERVAL_S = 0.5
# How long a failure report waits for the workers to be seen exited: a rank killed mid-step breaks
# rank 0's collective before the OS has reaped it, and the report should name that rank, not the
# collective's connection error (a loaded CI machine showed the gap).
_REAP_WAIT_S = 2.0
_JOIN_TIMEOUT_S = 10.0


class TensorParallelError(BaseException):
    """A rank failed or stopped answering: the engine cannot go on (see the module docstring)."""


def parse_core_binding(spec: Optional[str], world_size: int) -> Optional[list[list[int]]]:
    """VLLM_CPU_OMP_THREADS_BIND ("0-3|4-7", one core list per rank) -> cores per rank."""
    if not spec or spec == "auto":
        return None
    ranks = spec.split("|")
    if len(ranks) != world_size:
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={spec!r} lists {len(ranks)} core set(s); "
                         f"tensor_parallel_size={world_size} needs one per rank, separated by '|'.")
    cores = []
    for part in ranks:
        try:
            ids = []
            for item in part.split(","):
                first, _, last = item.partition("-")
                ids.extend(range(int(first), int(last or first) + 1))
        except ValueError:
            raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={spec!r}: {part!r} is not a core list like 0-3 or 0,2,4.")
        cores.append(ids)
    if len({c for ids in cores for c in ids}) != sum(len(ids) for ids in cores):
        raise ValueError(f"VLLM_CPU_OMP_THREADS_BIND={spec!r}: ranks must get disjoint cores.")
    return cores


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the OS picks it; free until someone
    binds it): the workers' rendezvous here, and the servers tests and benchmarks start."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Worker:
    def __init__(self, process: multiprocessing.Process, conn, rank: int):
        self.process, self.conn, self.rank = process, conn, rank

    def error(self) -> Optional[str]:
        """The error the worker reported before exiting, if it did."""
        try:
            while self.conn.poll():
                message = receive(self.conn)
                if message[0] == "error":
                    return message[1]
        except (EOFError, OSError):
            pass
        return None


class MultiprocExecutor:
    def __init__(self, vllm_config: VllmConfig):
        parallel = vllm_config.parallel_config
        self.world_size = parallel.tensor_parallel_size
        device = vllm_config.device_config.device
        cores = parse_core_binding(envs.VLLM_CPU_OMP_THREADS_BIND, self.world_size) if device.type == "cpu" else None
        timeout_s = envs.VLLM_TP_TIMEOUT_S or DEFAULT_TIMEOUT_S
        address = ("127.0.0.1", free_port())
        context = multiprocessing.get_context("spawn")
        self.workers: list[_Worker] = []
        self._failure_callbacks: list[Callable[[str], None]] = []
        self._pending_samples: dict[str, list[int]] = {}
        self.adapter_relay = AdapterRelay()
        self._closed = threading.Event()
        for rank in range(1, self.world_size):
            parent, child = context.Pipe()
            process = context.Process(
                target=run_worker, name=f"vllm-tp-rank{rank}", daemon=True,
                args=(_rank_config(vllm_config, cores, rank), rank, self.world_size, address, child, timeout_s,
                      cores[rank] if cores else None))
            process.start()
            child.close()
            self.workers.append(_Worker(process, parent, rank))
        # Runs on shutdown(), when the executor is collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self.workers, self._closed)
        try:
            if cores:
                os.sched_setaffinity(0, cores[0])
            init_tensor_parallel(0, self.world_size, address, device, timeout_s)
            self.driver = ModelRunner(_rank_config(vllm_config, cores, 0))
        except BaseException:
            self.shutdown()
            raise
        # Not a bound method: the thread must not keep the executor alive (`del llm` then frees it).
        threading.Thread(target=_watch_workers, args=(self.workers, self._closed, self._failure_callbacks),
                         name="vllm-tp-watchdog", daemon=True).start()
        logger.info("Tensor parallelism: %d ranks (%s), worker pids %s", self.world_size,
                    "nccl" if device.type == "cuda" else "gloo", [w.process.pid for w in self.workers])

    # ------------------------------------------------------------ the runner's surface
    @property
    def lora_manager(self):
        return self.driver.lora_manager

    @property
    def model(self):
        return self.driver.model

    def load_model(self) -> None:
        self._call_all("load_model")

    def profile_peak_bytes(self) -> int:
        return self._call_all("profile_peak_bytes")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self._call_all("initialize_kv_cache", num_blocks)

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(("step", self.adapter_relay.pack(sched), self._pending_samples))
        try:
            output = self.driver.execute_model(sched)
        except BaseException as e:
            raise TensorParallelError(f"a tensor-parallel step failed on rank 0 ({self._failure_report(e)})") from e
        self._pending_samples = {r: t for r, t in zip(output.req_ids, output.sampled_token_ids) if t}
        return output

    # ------------------------------------------------------------ lifecycle
    def add_failure_callback(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` runs (on the watchdog thread) when a worker exits unasked."""
        self._failure_callbacks.append(callback)

    def shutdown(self) -> None:
        self._finalizer()

    def _call_all(self, method: str, *args: Any) -> Any:
        self._broadcast(("call", method, args))
        try:
            result = getattr(self.driver, method)(*args)
        except BaseException:
            self.shutdown()
            raise
        for worker in self.workers:
            reply = self._reply(worker)
            if reply[0] != "ok":
                self.shutdown()
                raise RuntimeError(reply[1])
        return result

    def _reply(self, worker: _Worker) -> tuple:
        try:
            return receive(worker.conn)
        except (EOFError, OSError):
            return ("error", f"tensor-parallel rank {worker.rank} exited (code {worker.process.exitcode})")

    def _broadcast(self, message: tuple) -> None:
        try:
            for worker in self.workers:
                send(worker.conn, message)
        except OSError as e:
            raise TensorParallelError(f"a tensor-parallel worker is gone ({self._failure_report(e)})") from e

    def _failure_report(self, error: BaseException) -> str:
        deadline = time.monotonic() + _REAP_WAIT_S
        for worker in self.workers:  # a live worker costs the wait once; a dead one returns at once
            worker.process.join(max(0.0, deadline - time.monotonic()))
        dead = [f"rank {w.rank} exited with code {w.process.exitcode}" for w in self.workers
                if not w.process.is_alive()]
        reported = [text for w in self.workers if (text := w.error())]
        return "; ".join(dead + reported) or repr(error)



def _watch_workers(workers: list[_Worker], closed: threading.Event, callbacks: list[Callable[[str], None]]) -> None:
    while not closed.wait(_WATCH_INTERVAL_S):
        dead = [w for w in workers if not w.process.is_alive()]
        if dead:
            reason = "; ".join(f"tensor-parallel rank {w.rank} exited with code {w.process.exitcode}" for w in dead)
            logger.error("%s: the engine cannot continue", reason)
            for callback in callbacks:
                callback(reason)
            return


def _rank_config(config: VllmConfig, cores: Optional[list[list[int]]], rank: int) -> VllmConfig:
    """The config one rank runs with: CUDA device `rank`; on the CPU its own thread count when
    its cores are bound."""
    device_config = config.device_config
    if device_config.device.type == "cuda":
        device_config = dataclasses.replace(device_config, device=torch.device("cuda", rank))
    elif cores:
        device_config = dataclasses.replace(device_config, cpu_threads=len(cores[rank]))
    return dataclasses.replace(config, device_config=device_config)


def _stop_workers(workers: list[_Worker], closed: threading.Event) -> None:
    closed.set()
    for worker in workers:
        try:
            send(worker.conn, ("shutdown",))
        except OSError:
            pass
    for worker in workers:
        worker.process.join(_JOIN_TIMEOUT_S)
        if worker.process.is_alive():
            worker.process.kill()
            worker.process.join()
        worker.conn.close()
    destroy_tensor_parallel()
