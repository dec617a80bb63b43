"""Processes for the scale-out tests: `vllm-router` (the vLLM project's Rust router, from the
`vllm-router` package) in front of `vllm serve` replicas started by `RemoteOpenAIServer`.

`RouterProcess` runs the router's console script on free 127.0.0.1 ports (its own and its
Prometheus port, so parallel sessions never collide), is ready once GET /readiness answers 200,
and is stopped with SIGTERM (then SIGKILL) on `close()`. Its log goes to a file that is shown
when start-up fails. Health checks run every second and one failure marks a replica unhealthy,
so a killed replica leaves the rotation within about a second.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from typing import Optional

import httpx

from tests.entrypoints.utils import RemoteOpenAIServer, free_port

ROUTER_BINARY = "vllm-router"


def router_missing_reason() -> Optional[str]:
    """Why the router cannot run here, or None when it can."""
    if shutil.which(ROUTER_BINARY) is None:
        return "the vllm-router binary is not installed (pip install vllm-router==0.1.17, in the dev extra)"
    return None


class RouterProcess:
    def __init__(self, worker_urls: list[str], policy: str, extra_args: tuple[str, ...] = (), timeout: float = 60.0):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-router-", suffix=".log", delete=False)
        command = [ROUTER_BINARY, "--host", "127.0.0.1", "--port", str(self.port), "--worker-urls", *worker_urls,
                   "--policy", policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
                   "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
                   "--worker-startup-check-interval", "1", "--log-level", "warning", *extra_args]
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vllm-router exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/readiness", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise TimeoutError(f"vllm-router not ready after {timeout}s")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def workers(self) -> dict[str, bool]:
        """Replica URL -> healthy, as the router sees them."""
        listing = httpx.get(self.url + "/workers", timeout=5.0).json()["workers"]
        return {w["url"]: w["is_healthy"] for w in listing}

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> "RouterProcess":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def start_replicas(model: str, args: list[str], count: int, env: Optional[dict[str, str]] = None,
                   timeout: float = 240.0) -> list[RemoteOpenAIServer]:
    """`count` `vllm serve` replicas of `model`, started at the same time (start-up dominates)."""
    replicas: list[Optional[RemoteOpenAIServer]] = [None] * count
    errors: list[BaseException] = []

    def start(i: int) -> None:
        try:
            replicas[i] = RemoteOpenAIServer(model, args, env=env, timeout=timeout)
        except BaseException as e:  # reported below, after every thread ended
            errors.append(e)

    threads = [threading.Thread(target=start, args=(i,)) for i in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        for replica in replicas:
            if replica is not None:
                replica.close()
        raise errors[0]
    return [r for r in replicas if r is not None]


def requests_served(replica: RemoteOpenAIServer) -> float:
    """Finished requests of one replica (`vllm:request_success_total`, all reasons)."""
    return replica.metrics().get("vllm:request_success_total", 0.0)
