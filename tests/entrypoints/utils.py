"""`RemoteOpenAIServer`: a real `vllm serve` process on a free 127.0.0.1 port.

The server runs as `python -m vllm.entrypoints.cli.main serve ...` (the console script
need not be installed), is ready once GET /health answers 200, and is terminated
(SIGTERM, then SIGKILL) on `close()`. Its output goes to a log file that is shown when
start-up fails.
"""

from __future__ import annotations

import os
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from typing import Optional, Union

import httpx
import openai

from vllm.executor.multiproc import free_port

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RemoteOpenAIServer:
    def __init__(self, model: str, args: list[str], env: Optional[dict[str, str]] = None,
                 api_key: Optional[str] = None, timeout: float = 120.0, api_server_module: bool = False,
                 verify: Union[bool, ssl.SSLContext] = True):
        """`api_server_module`: start `python -m vllm.entrypoints.openai.api_server --model MODEL` instead
        of `vllm serve MODEL`; `verify`: an SSL context trusting the server's certificate when it speaks HTTPS (--ssl-certfile)."""
        self.port = free_port()
        self.api_key = api_key
        self.verify = verify
        self.url = f"{'https' if '--ssl-certfile' in args else 'http'}://127.0.0.1:{self.port}"
        environment = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
        environment["PYTHONPATH"] = REPO_ROOT + os.pathsep + environment.get("PYTHONPATH", "")
        self.log = tempfile.NamedTemporaryFile("w+", prefix="vllm-serve-", suffix=".log", delete=False)
        entry = ["vllm.entrypoints.openai.api_server", "--model"] if api_server_module else [
            "vllm.entrypoints.cli.main", "serve"]
        command = [sys.executable, "-m", *entry, model, "--host", "127.0.0.1",
                   "--port", str(self.port), "--disable-uvicorn-access-log", *args]
        self.proc = subprocess.Popen(command, env=environment, stdout=self.log, stderr=subprocess.STDOUT,
                                     cwd=REPO_ROOT)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.close()
        raise TimeoutError(f"server not ready after {timeout}s:\n{self.output()}")

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def client(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=self.api_key or "EMPTY", max_retries=0, **kwargs)

    def async_client(self, **kwargs) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=self.api_key or "EMPTY", max_retries=0,
                                  **kwargs)

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: series name (labels dropped) -> summed value."""
        values: dict[str, float] = {}
        for line in httpx.get(self.url + "/metrics").text.splitlines():
            if not line or line.startswith("#"):
                continue
            name, value = line.rsplit(" ", 1)
            name = name.split("{", 1)[0]
            values[name] = values.get(name, 0.0) + float(value)
        return values

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)

    def __enter__(self) -> "RemoteOpenAIServer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
