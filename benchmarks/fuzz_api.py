"""Property-based fuzzing of every HTTP route from the server's own OpenAPI schema
(schemathesis over hypothesis), with the checks the CI test shares.

    python benchmarks/fuzz_api.py --max-examples 200                 # starts `vllm serve` on the default model
    python benchmarks/fuzz_api.py --model DIR --lora-modules a=PATH  # another model, with adapters
    python benchmarks/fuzz_api.py --url http://host:8000             # a running server

For every operation in `/openapi.json` (routes without a body schema are fuzzed through
their query/headers only) it draws `--max-examples` requests that fit the schema
(positive) and as many that break it (negative: wrong types, out-of-range values,
missing fields), sends them one at a time, and checks each answer:

- no 5xx, neither as a status nor as an error event inside a stream;
- no hang: every answer within `--timeout` seconds;
- every 4xx is OpenAI-shaped: `{"error": {"message": non-empty str, "type": str,
  "param": str or null, "code": the status}}`;
- every 2xx with a JSON content type parses; a stream is server-sent events whose data
  lines are JSON and whose last one is `[DONE]`. Routes that answer plain text
  (`/metrics`, `/health`, adapter loading) are exempt from the JSON rule.

It prints cases tried and statuses seen per route, then the failure counts and the first
failing requests of each kind (as curl commands), and exits 1 on any failure.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import json
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Optional

import requests

# Routes whose 2xx body is not JSON by design (plain text, Prometheus text, or empty).
NON_JSON_OK = ("/health", "/ping", "/metrics", "/reset_prefix_cache", "/v1/load_lora_adapter",
               "/v1/unload_lora_adapter")
FAILURE_KINDS = ("5xx", "unshaped 4xx", "bad 2xx body", "hang", "dropped connection")
_MAX_STREAM_EVENTS = 100_000
_EXAMPLES_KEPT = 3  # failing requests kept per (route, kind) for the report


def check_response(path: str, status: int, content_type: str, body: bytes) -> Optional[tuple[str, str]]:
    """(failure kind, why) for an answer that breaks the server's contract, else None."""
    if status >= 500:
        return "5xx", f"status {status}: {body[:300]!r}"
    if 400 <= status < 500:
        problem = openai_error_problem(body, status)
        return ("unshaped 4xx", f"status {status}: {problem}: {body[:300]!r}") if problem else None
    if 200 <= status < 300:
        if content_type.startswith("text/event-stream"):
            problem = sse_problem(body)
        elif content_type.startswith("application/json"):
            problem = _json_problem(body)
        elif path in NON_JSON_OK:
            problem = None
        else:
            problem = f"content type {content_type!r} on a JSON route"
        return ("bad 2xx body", f"{problem}: {body[:300]!r}") if problem else None
    return None


def openai_error_problem(body: bytes, status: int) -> Optional[str]:
    """What is wrong with an error body, or None when it is `{"error": {message, type, param, code}}`."""
    try:
        payload = json.loads(body)
    except ValueError:
        return "body is not JSON"
    error = payload.get("error") if isinstance(payload, dict) else None
    if not isinstance(error, dict):
        return "no 'error' object"
    if not isinstance(error.get("message"), str) or not error["message"]:
        return "error.message is not a non-empty string"
    if not isinstance(error.get("type"), str):
        return "error.type is not a string"
    if "param" not in error or not (error["param"] is None or isinstance(error["param"], str)):
        return "error.param is not a string or null"
    if error.get("code") != status:
        return f"error.code {error.get('code')!r} is not the status {status}"
    return None


# The Responses API's terminal events (its streams carry `event:` lines and no [DONE], as OpenAI's).
_RESPONSES_ENDS = ("response.completed", "response.incomplete", "error")
_SERVER_ERROR_TYPES = ("InternalServerError", "ServiceUnavailableError")


def sse_problem(body: bytes) -> Optional[str]:
    """What is wrong with a server-sent-event stream, or None. An error event is fine when
    it is a shaped 4xx (a request can fail after its first byte); a 5xx event is not."""
    data = [line[len(b"data: "):] for line in body.splitlines() if line.startswith(b"data: ")]
    if not data:
        return "stream without data events"
    if any(line.startswith(b"event: ") for line in body.splitlines()):
        return _responses_stream_problem(data)
    if data[-1].strip() != b"[DONE]":
        return "stream does not end with [DONE]"
    for event in data[:-1]:
        try:
            payload = json.loads(event)
        except ValueError:
            return f"event is not JSON: {event[:100]!r}"
        error = payload.get("error") if isinstance(payload, dict) else None
        if isinstance(error, dict):
            code = error.get("code")
            if not isinstance(code, int) or code >= 500:
                return f"error event with code {code!r}"
            problem = openai_error_problem(event, code)
            if problem:
                return f"error event: {problem}"
    return None


def _responses_stream_problem(data: list[bytes]) -> Optional[str]:
    """A Responses stream: JSON events, the last one terminal, no server-error event."""
    try:
        events = [json.loads(event) for event in data]
    except ValueError as e:
        return f"event is not JSON ({e})"
    last = events[-1].get("type") if isinstance(events[-1], dict) else None
    if last not in _RESPONSES_ENDS:
        return f"Responses stream ends with {last!r}, not one of {', '.join(_RESPONSES_ENDS)}"
    errors = [e for e in events if isinstance(e, dict) and e.get("type") == "error"]
    if any(e.get("code") in _SERVER_ERROR_TYPES or not e.get("message") for e in errors):
        return f"Responses error event: {errors[0]}"
    return None


def _json_problem(body: bytes) -> Optional[str]:
    try:
        json.loads(body)
    except ValueError as e:
        return f"invalid JSON ({e})"
    return None


@dataclass
class FuzzReport:
    cases: Counter = field(default_factory=Counter)  # route -> requests sent
    statuses: dict = field(default_factory=lambda: defaultdict(Counter))  # route -> status -> count
    failures: Counter = field(default_factory=Counter)  # kind -> count
    examples: dict = field(default_factory=lambda: defaultdict(list))  # (route, kind) -> [(why, curl)]

    @property
    def total(self) -> int:
        return sum(self.cases.values())

    @property
    def ok(self) -> bool:
        return not sum(self.failures.values())

    def record(self, route: str, status: Optional[int], failure: Optional[tuple[str, str]], curl: str) -> None:
        self.cases[route] += 1
        self.statuses[route]["timeout" if status is None else status] += 1
        if failure is not None:
            kind, why = failure
            self.failures[kind] += 1
            if len(self.examples[(route, kind)]) < _EXAMPLES_KEPT:
                self.examples[(route, kind)].append((why, curl))

    def summary(self) -> str:
        lines = [f"{'route':<36} {'cases':>6}  statuses"]
        for route in sorted(self.cases):
            seen = ", ".join(f"{s}: {n}" for s, n in sorted(self.statuses[route].items(), key=lambda kv: str(kv[0])))
            lines.append(f"{route:<36} {self.cases[route]:>6}  {seen}")
        lines.append(f"total {self.total} requests; " + ", ".join(f"{k}: {self.failures[k]}" for k in FAILURE_KINDS))
        for (route, kind), found in sorted(self.examples.items()):
            for why, curl in found:
                lines.append(f"\n[{kind}] {route}: {why}\n    {curl}")
        return "\n".join(lines)


def fuzz(url: str, max_examples: int, timeout: float = 30.0, seed: Optional[int] = 0,
         headers: Optional[dict[str, str]] = None, log=None) -> FuzzReport:
    """Fuzz every operation of the server at `url`: `max_examples` positive and as many
    negative requests each. `seed` makes a run repeatable (None: a fresh one)."""
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, seed as hypothesis_seed, settings
    from schemathesis import GenerationMode

    # With --api-key the schema itself needs the key.
    auth = {"headers": headers} if headers else {}
    schema = schemathesis.openapi.from_url(url.rstrip("/") + "/openapi.json", **auth)
    # Read whole streams (schemathesis stops after 20 events by default): [DONE] is checked.
    schema.config.max_stream_events = _MAX_STREAM_EVENTS
    report = FuzzReport()
    session = requests.Session()
    config = settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
                      phases=[Phase.generate], suppress_health_check=list(HealthCheck), print_blob=False)
    for result in schema.get_all_operations():
        operation = result.ok()
        route = f"{operation.method.upper()} {operation.path}"
        # A route without inputs (GET /health) has no invalid request to draw.
        has_inputs = operation.body or any(True for _ in operation.iter_parameters())
        modes = (GenerationMode.POSITIVE, GenerationMode.NEGATIVE) if has_inputs else (GenerationMode.POSITIVE,)
        for mode in modes:
            started = time.perf_counter()

            def send(case) -> None:
                report.record(route, *_send(case, url, session, timeout, headers))

            test = config(given(operation.as_strategy(generation_mode=mode))(send))
            if seed is not None:
                test = hypothesis_seed(seed)(test)
            test()
            if log is not None:
                log(f"{route} [{mode.value}] {time.perf_counter() - started:.1f}s")
    return report


def _send(case, url: str, session: requests.Session, timeout: float, headers: Optional[dict[str, str]]):
    """(status or None on a hang, failure or None, curl command) of one generated request."""
    try:
        response = case.call(base_url=url, session=session, headers=headers, timeout=timeout)
    except requests.Timeout:
        return None, ("hang", f"no answer within {timeout}s"), _curl(case)
    except requests.ConnectionError as e:
        return None, ("dropped connection", repr(e)), _curl(case)
    if response.stream_cut_short:  # schemathesis stopped reading a stream at the timeout
        return None, ("hang", f"stream not finished within {timeout}s"), _curl(case)
    content_type = (response.headers.get("content-type") or [""])[0]
    failure = check_response(case.operation.path, response.status_code, content_type, response.content)
    return response.status_code, failure, _curl(case) if failure else ""


def _curl(case) -> str:
    try:
        return case.as_curl_command()
    except Exception as e:  # the case itself may be unprintable (e.g. invalid UTF-8 in a header)
        return f"<no curl command: {e!r}>"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default=None, help="a running server (default: start one here)")
    parser.add_argument("--model", default=None, help="model folder to serve (default: the packaged default model)")
    parser.add_argument("--lora-modules", nargs="*", default=[], help="name=path adapters to serve")
    parser.add_argument("--max-model-len", type=int, default=128, help="small, so generations stay short")
    parser.add_argument("--max-examples", type=int, default=100, help="positive and negative cases per route each")
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds before a request counts as a hang")
    parser.add_argument("--seed", type=int, default=None, help="repeat a run (default: a fresh one)")
    parser.add_argument("--api-key", default=None, help="sent as a bearer token")
    args = parser.parse_args()
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else None
    server, url = None, args.url
    try:
        if url is None:
            import tempfile

            from benchmarks.common import launch_server
            from vllm.model_executor.default_model import ensure_default_model

            flags = ["--max-model-len", str(args.max_model_len), "--max-num-seqs", "8"]
            if args.lora_modules:
                flags += ["--enable-lora", "--enable-activated-lora", "--max-lora-rank", "64",
                          "--lora-modules", *args.lora_modules]
            log_path = os.path.join(tempfile.mkdtemp(prefix="vllm-fuzz-"), "server.log")
            server, url = launch_server(args.model or ensure_default_model(), flags, log_path,
                                        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"})
        started = time.perf_counter()
        report = fuzz(url, args.max_examples, args.timeout, args.seed, headers, log=print)
        print(report.summary())
        print(f"\n{time.perf_counter() - started:.0f}s against {url}")
    finally:
        if server is not None:
            from benchmarks.common import stop_server

            stop_server(server)
    sys.exit(0 if report.ok else 1)


if __name__ == "__main__":
    main()
