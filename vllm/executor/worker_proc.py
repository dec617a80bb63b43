"""The body of a tensor-parallel worker process (ranks 1..N-1): a `ModelRunner` over this rank's
shard that does what the engine process's executor tells it through a pipe.

Messages (pickled tuples, engine -> worker):
    ("call", method, args)     run a runner method (load_model, profile_peak_bytes,
                               initialize_kv_cache); answered ("ok", result) or ("error", text)
    ("step", sched, samples)   apply rank 0's samples of the previous step (`samples`:
                               req_id -> sampled tokens), then execute `sched` (adapter
                               weights restored by executor/adapter_relay.py); not answered:
                               the step's collectives keep the ranks in lock step
    ("shutdown",)              leave the process group and exit 0

Invariants:
- Every rank runs every step with the same scheduler output and the same token history, so
  every rank issues the same collectives. A worker samples too (the LM head's all-gather needs
  it) but its samples are replaced by rank 0's before they are used: rank 0's are the step's.
- A worker never outlives the engine process: the kernel kills it when its parent dies
  (PR_SET_PDEATHSIG on Linux), and a closed pipe ends its loop. Any error in a worker is sent
  to the engine (best effort) and ends the process with status 1, which fails rank 0's next
  collective at once.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
import sys
import traceback
from multiprocessing.connection import Connection
from typing import Optional, Sequence

from vllm.config import VllmConfig

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before prctl took effect
        os._exit(1)


def send(conn: Connection, message: tuple) -> None:
    conn.send_bytes(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL))


def receive(conn: Connection) -> tuple:
    return pickle.loads(conn.recv_bytes())


def run_worker(config: VllmConfig, rank: int, world_size: int, address: tuple[str, int], conn: Connection,
               timeout_s: float, cores: Optional[Sequence[int]]) -> None:
    """Entry point of the worker process of `rank` (multiprocessing, spawn)."""
    _die_with_parent()
    if cores:
        os.sched_setaffinity(0, cores)
    from vllm.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
    from vllm.worker.model_runner import ModelRunner

    try:
        init_tensor_parallel(rank, world_size, address, config.device_config.device, timeout_s)
        runner = ModelRunner(config)
        _serve(runner, conn)
    except EOFError:  # the engine closed the pipe: it is gone
        os._exit(0)
    except BaseException:  # noqa: BLE001 - reported to the engine, then the rank ends
        text = f"tensor-parallel rank {rank} failed:\n{traceback.format_exc()}"
        print(text, file=sys.stderr, flush=True)
        try:
            send(conn, ("error", text))
        except OSError:
            pass
        os._exit(1)
    destroy_tensor_parallel()


def _serve(runner, conn: Connection) -> None:
    from vllm.executor.adapter_relay import AdapterRelay

    relay = AdapterRelay()
    while True:
        message = receive(conn)
        kind = message[0]
        if kind == "shutdown":
            return
        if kind == "step":
            _, sched, samples = message
            runner.apply_driver_samples(samples)
            runner.execute_model(relay.unpack(sched))
        elif kind == "call":
            _, method, args = message
            send(conn, ("ok", getattr(runner, method)(*args)))
        else:
            raise RuntimeError(f"unknown message {kind!r}")
