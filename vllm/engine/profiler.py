"""`StepProfiler`: torch.profiler around engine steps, behind `LLM.start_profile()` /
`LLM.stop_profile()` (vLLM's methods and its `VLLM_TORCH_PROFILER_DIR` variable).

Invariants:
- At most one profile runs at a time; `start` while one runs and `stop` without one are
  RuntimeErrors, and so is `start` without `VLLM_TORCH_PROFILER_DIR` (read at `start`, so it
  may be set after the engine is built).
- It records CPU activity, and CUDA activity when the engine's device is a GPU, on the
  thread that calls `start` (the thread that steps the engine).
- When `stop` returns, the trace is on disk: `<host>_<pid>.<ms>.pt.trace.json.gz` in that
  folder (Chrome trace format, as vLLM writes it), and `stop` returns its path.
- Every engine step inside a profile appears as one `engine_step` range.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from typing import Iterator, Optional

import torch

from vllm import envs
from vllm.logger import init_logger

logger = init_logger(__name__)


class StepProfiler:
    def __init__(self, device: torch.device):
        self.device = device
        self._profile: Optional[torch.profiler.profile] = None
        self._trace_path: Optional[str] = None

    @property
    def active(self) -> bool:
        return self._profile is not None

    def start(self) -> None:
        folder = envs.VLLM_TORCH_PROFILER_DIR
        if not folder:
            raise RuntimeError("Profiling is not enabled: set VLLM_TORCH_PROFILER_DIR to the folder where traces "
                               "should be written, then call start_profile() again.")
        if self._profile is not None:
            raise RuntimeError("A profile is already running; call stop_profile() first.")
        folder = os.path.abspath(os.path.expanduser(folder))
        os.makedirs(folder, exist_ok=True)
        name = f"{socket.gethostname()}_{os.getpid()}.{int(time.time() * 1000)}.pt.trace.json.gz"
        self._trace_path = os.path.join(folder, name)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profile = torch.profiler.profile(activities=activities)
        self._profile.start()
        logger.info("Profiling engine steps; the trace goes to %s", self._trace_path)

    def stop(self) -> str:
        if self._profile is None:
            raise RuntimeError("No profile is running; call start_profile() first.")
        profile, path = self._profile, self._trace_path
        self._profile = self._trace_path = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        profile.stop()
        profile.export_chrome_trace(path)
        logger.info("Profiler trace written to %s", path)
        return path

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """Wraps one engine step (a no-op when no profile runs)."""
        if self._profile is None:
            yield
            return
        with torch.profiler.record_function("engine_step"):
            yield
