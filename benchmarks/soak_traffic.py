"""The soak harness's traffic (benchmarks/soak.py): what the server serves, prompts of a
wanted token length, and one client's loop over the request mix, each request streamed,
read to the end or cut off on purpose, and checked.

What it owns:
- `Target`: the server's base model name, max_model_len and adapters (aLoRAs with their
  invocation text), discovered from /v1/models, so the harness needs no tokenizer;
- prompt text of about a wanted length (random common words), measured exactly with the
  server's /tokenize: that count is what `usage.prompt_tokens` must equal;
- `Outcome`: one request's result and verdict: "ok", "wrong" (finished, but with the
  wrong length, usage or JSON), "failed" (an HTTP error, an error event, a broken stream)
  or "cancelled" (cut off on purpose);
- `Traffic`: the mix (`MIX` unless given, e.g. one kind alone to find which one leaks) and
  one client's loop until a deadline.

Invariants: prompt + max_tokens <= max_model_len for every request; every request but
structured output asks for an exact length (`ignore_eos` and `min_tokens` = `max_tokens`),
so the finish must be "length" with exactly max_tokens tokens per choice; tokens received
are counted from the stream's per-token logprob entries (one chunk may carry several
tokens when the reader lags), independently of the usage the server reports.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Optional

import httpx

# Request kinds and their shares of the mix. "alora" is a pair: the base model answers a
# conversation, then the aLoRA gets that conversation plus its invocation text, so its prompt
# starts with blocks the base request just computed.
MIX = {"base": 0.30, "lora": 0.20, "alora": 0.20, "structured": 0.15, "n": 0.15}

# Prompts are random common words: one or two tokens each in most tokenizers.
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part over new sound take only little work know place year live me back give most very "
         "after thing our just name good sentence man think say great where help through much before line right "
         "too mean old any same tell boy follow came want show also around form three small set put end does "
         "another well large must big even such because turn here why ask went men read need land different home "
         "us move try kind hand picture again change off play spell air away animal house point page letter mother "
         "answer found study still learn should america world").split()

# Structured requests: a small closed schema, without free whitespace, so the grammar ends in
# well under STRUCTURED_MAX_TOKENS tokens whatever the weights are.
SCHEMA = {"type": "object", "properties": {"label": {"enum": ["yes", "no", "unsure"]}, "ok": {"type": "boolean"}},
          "required": ["label", "ok"], "additionalProperties": False}
STRUCTURED_MAX_TOKENS = 48


@dataclass
class Target:
    base: str
    max_model_len: int
    loras: list[str]
    aloras: dict[str, str]  # name -> invocation text
    base_root: Optional[str] = None
    invocation_ids: Optional[list[int]] = None  # of the first aLoRA: for runtime aLoRAs


@dataclass
class Outcome:
    kind: str
    status: str  # ok | wrong | failed | cancelled
    detail: str = ""
    cancel_phase: Optional[str] = None  # prefill | stream
    ttft: Optional[float] = None
    tokens: int = 0
    prompt_tokens: int = 0
    max_tokens: int = 0
    text: str = ""  # the first choice's text (the aLoRA pair continues the conversation with it)


@dataclass
class _Stream:
    tokens: dict[int, int] = field(default_factory=dict)
    texts: dict[int, str] = field(default_factory=dict)
    token_texts: dict[int, str] = field(default_factory=dict)
    finish: dict[int, Optional[str]] = field(default_factory=dict)
    usage: Optional[dict] = None
    first_token: Optional[float] = None
    done: bool = False

    @property
    def total(self) -> int:
        return sum(self.tokens.values())


class _Cut(Exception):
    """Raised inside the stream reader to close the response mid-stream on purpose."""


class RequestFailed(Exception):
    pass


class Traffic:
    """Sends the mix over one shared connection pool and keeps every outcome."""

    def __init__(self, http: httpx.AsyncClient, target: Target, output_len: tuple[int, int],
                 cancel_fraction: float, seed: int, mix: Optional[dict[str, float]] = None):
        self.http = http
        self.weights = dict(mix or MIX)
        self.target = target
        self.output_len = output_len
        self.cancel_fraction = cancel_fraction
        self.seed = seed
        self.outcomes: list[Outcome] = []
        self.alora_skipped = 0  # aLoRA follow-ups not sent: no room left under max_model_len
        self.tokens_per_word = 1.5  # refined by `calibrate`
        self._ttfts: list[float] = []  # recent TTFTs: how long a pre-first-token cut may wait

    async def calibrate(self) -> None:
        text = " ".join(random.Random(self.seed).choice(WORDS) for _ in range(400))
        self.tokens_per_word = await self.count(text) / 400

    async def count(self, prompt: str) -> int:
        response = await self.http.post("/tokenize", json={"model": self.target.base, "prompt": prompt})
        if response.status_code != 200:
            raise RequestFailed(f"/tokenize: HTTP {response.status_code}: {response.text[:300]}")
        return response.json()["count"]

    async def count_chat(self, messages: list[dict]) -> int:
        response = await self.http.post("/tokenize", json={"model": self.target.base, "messages": messages,
                                                            "add_generation_prompt": True})
        if response.status_code != 200:
            raise RequestFailed(f"/tokenize (chat): HTTP {response.status_code}: {response.text[:300]}")
        return response.json()["count"]

    # ------------------------------------------------------------------ prompts
    async def prompt(self, rng: random.Random, budget: int, suffix: str = "") -> tuple[str, int]:
        """Text whose token count (measured) is spread log-uniformly from 10 to `budget`."""
        want = int(math.exp(rng.uniform(math.log(10), math.log(max(11, budget)))))
        words = max(1, round(want / self.tokens_per_word))
        for _ in range(6):
            text = " ".join(rng.choice(WORDS) for _ in range(words)) + suffix
            count = await self.count(text)
            if count <= budget:
                return text, count
            words = max(1, int(words * budget / count) - 2)
        raise RequestFailed(f"could not build a prompt of at most {budget} tokens")

    def _out_len(self, rng: random.Random) -> int:
        return rng.randint(*self.output_len)

    # ------------------------------------------------------------------ the client loop
    async def client_loop(self, client_id: int, deadline: float) -> None:
        rng = random.Random(self.seed * 100003 + client_id)
        kinds, weights = zip(*self._mix().items())
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            try:
                await getattr(self, f"_send_{kind}")(rng)
            except RequestFailed as e:  # a /tokenize failure: the server misbehaved before the request
                self.outcomes.append(Outcome(kind, "failed", str(e)))
            except httpx.HTTPError as e:  # counted, and the client carries on
                self.outcomes.append(Outcome(kind, "failed", f"{type(e).__name__} on /tokenize: {e}"))

    def _mix(self) -> dict[str, float]:
        """The weights, less the adapter kinds the server has no adapter for."""
        mix = {k: w for k, w in self.weights.items() if w > 0}
        if not self.target.loras:
            mix.pop("lora", None)
        if not self.target.aloras:
            mix.pop("alora", None)
        if not mix:
            raise ValueError(f"nothing left to send: the mix {self.weights} needs adapters the server lacks")
        return mix

    async def _send_base(self, rng: random.Random) -> None:
        await self.completion(rng, "base", self.target.base)

    async def _send_lora(self, rng: random.Random) -> None:
        await self.completion(rng, "lora", rng.choice(self.target.loras))

    async def _send_n(self, rng: random.Random) -> None:
        await self.completion(rng, "n", self.target.base, n=rng.randint(2, 3))

    async def completion(self, rng: random.Random, kind: str, model: str, n: int = 1, suffix: str = "") -> Outcome:
        max_tokens = self._out_len(rng)
        text, count = await self.prompt(rng, self.target.max_model_len - max_tokens, suffix)
        return await self.send(rng, kind, "/v1/completions", self._completion_body(model, text, max_tokens, n),
                               count, max_tokens, n)

    async def _send_alora(self, rng: random.Random) -> None:
        name = rng.choice(sorted(self.target.aloras))
        invocation = self.target.aloras[name]
        first, second = self._out_len(rng), self._out_len(rng)
        # Room for the base answer, the invocation and the aLoRA's answer after the conversation.
        reserve = first + second + len(invocation) + 16
        text, count = await self.prompt(rng, self.target.max_model_len - reserve)
        base = await self.send(rng, "base", "/v1/completions",
                               self._completion_body(self.target.base, text, first, 1), count, first, 1)
        conversation = text + base.text + invocation
        count = await self.count(conversation)
        second = min(second, self.target.max_model_len - count)
        if second < 1:
            # The base answer re-tokenised longer than it was generated (text does not round-trip
            # token for token), so no aLoRA request fits: the client's budget, not a server fault.
            self.alora_skipped += 1
            return
        await self.send(rng, "alora", "/v1/completions", self._completion_body(name, conversation, second, 1),
                        count, second, 1)

    async def _send_structured(self, rng: random.Random) -> None:
        # Room for the chat template's own tokens (a default system prompt, role markup).
        budget = self.target.max_model_len - STRUCTURED_MAX_TOKENS - 128
        words = " ".join(rng.choice(WORDS) for _ in range(8))
        body_text, _ = await self.prompt(rng, budget)
        messages = [{"role": "user", "content": f"Answer in JSON. {words} {body_text}"}]
        count = await self.count_chat(messages)
        if count + STRUCTURED_MAX_TOKENS > self.target.max_model_len:
            raise RequestFailed(f"chat prompt of {count} tokens leaves no room for {STRUCTURED_MAX_TOKENS}")
        body = {"model": self.target.base, "messages": messages, "max_tokens": STRUCTURED_MAX_TOKENS,
                "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
                "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": True}}
        await self.send(rng, "structured", "/v1/chat/completions", body, count, STRUCTURED_MAX_TOKENS, 1)

    @staticmethod
    def _completion_body(model: str, prompt: str, max_tokens: int, n: int) -> dict:
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "min_tokens": max_tokens,
                "ignore_eos": True, "n": n, "temperature": 1.0 if n > 1 else 0.0, "logprobs": 0, "stream": True,
                "stream_options": {"include_usage": True}}

    # ------------------------------------------------------------------ one request
    async def send(self, rng: random.Random, kind: str, path: str, body: dict, prompt_tokens: int,
                   max_tokens: int, n: int) -> Outcome:
        """Stream one request; with probability `cancel_fraction` cut it off on purpose, half of
        those before the first token (a random moment within a typical TTFT), half after a
        random number of tokens. Records and returns the outcome."""
        state, start = _Stream(), time.monotonic()
        plan = None
        if rng.random() < self.cancel_fraction:
            plan = "prefill" if rng.random() < 0.5 else "stream"
        cut_after = rng.randint(1, max(1, max_tokens * n - 1)) if plan == "stream" else None
        outcome = Outcome(kind, "ok", prompt_tokens=prompt_tokens, max_tokens=max_tokens)
        try:
            reader = self._read(path, body, state, cut_after)
            if plan == "prefill":
                await asyncio.wait_for(reader, timeout=rng.uniform(0.0, self._typical_ttft()))
            else:
                await reader
        except (asyncio.TimeoutError, _Cut):
            outcome.status, outcome.cancel_phase = "cancelled", "prefill" if state.first_token is None else "stream"
        except RequestFailed as e:
            outcome.status, outcome.detail = "failed", str(e)
        except (httpx.HTTPError, json.JSONDecodeError) as e:
            outcome.status, outcome.detail = "failed", f"{type(e).__name__}: {e}"
        outcome.tokens = state.total
        outcome.text = state.texts.get(0, "")
        if state.first_token is not None:
            outcome.ttft = state.first_token - start
        if outcome.status == "ok":
            outcome.detail = self._verify(kind, state, prompt_tokens, max_tokens, n)
            outcome.status = "wrong" if outcome.detail else "ok"
            if outcome.ttft is not None:
                self._ttfts = (self._ttfts + [outcome.ttft])[-200:]
        self.outcomes.append(outcome)
        return outcome

    def _typical_ttft(self) -> float:
        if not self._ttfts:
            return 0.2
        return sorted(self._ttfts)[len(self._ttfts) // 2]

    async def _read(self, path: str, body: dict, state: _Stream, cut_after: Optional[int]) -> None:
        async with self.http.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                raise RequestFailed(f"HTTP {response.status_code}: {text[:300]}")
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    state.done = True
                    return
                chunk = json.loads(data)
                if "error" in chunk:
                    raise RequestFailed(f"error event: {json.dumps(chunk['error'])[:300]}")
                _absorb(chunk, state)
                if cut_after is not None and state.total >= cut_after:
                    raise _Cut()
        if not state.done:
            raise RequestFailed("the stream ended without [DONE]")

    @staticmethod
    def _verify(kind: str, state: _Stream, prompt_tokens: int, max_tokens: int, n: int) -> str:
        """"" when the finished stream is right, else what was wrong."""
        problems = []
        usage = state.usage
        if usage is None:
            problems.append("no usage chunk")
        else:
            if usage.get("prompt_tokens") != prompt_tokens:
                problems.append(f"usage.prompt_tokens {usage.get('prompt_tokens')} != /tokenize {prompt_tokens}")
            if usage.get("completion_tokens") != state.total:
                problems.append(f"usage.completion_tokens {usage.get('completion_tokens')} != {state.total} received")
        if sorted(state.finish) != list(range(n)):
            problems.append(f"choices {sorted(state.finish)} finished, expected {n}")
        for i, reason in state.finish.items():
            got = state.tokens.get(i, 0)
            if kind == "structured":
                if got > max_tokens:
                    problems.append(f"{got} tokens > max_tokens {max_tokens}")
                problems += _json_problems(state.texts.get(i, ""))
            else:
                if reason != "length" or got != max_tokens:
                    problems.append(f"choice {i}: finish {reason!r} after {got} tokens, asked for {max_tokens}")
                if state.token_texts.get(i, "") != state.texts.get(i, ""):
                    problems.append(f"choice {i}: text differs from the concatenated per-token texts")
        return "; ".join(problems)


def _absorb(chunk: dict, state: _Stream) -> None:
    """One SSE chunk of /v1/completions or /v1/chat/completions into the stream state."""
    if chunk.get("usage"):
        state.usage = chunk["usage"]
    for choice in chunk.get("choices") or []:
        i = choice.get("index", 0)
        if "delta" in choice:  # chat
            text = (choice["delta"] or {}).get("content") or ""
            entries = (choice.get("logprobs") or {}).get("content") or []
            pieces = [e.get("token", "") for e in entries]
        else:
            text = choice.get("text") or ""
            pieces = (choice.get("logprobs") or {}).get("tokens") or []
        if pieces and state.first_token is None:
            state.first_token = time.monotonic()
        state.tokens[i] = state.tokens.get(i, 0) + len(pieces)
        state.texts[i] = state.texts.get(i, "") + text
        state.token_texts[i] = state.token_texts.get(i, "") + "".join(pieces)
        if choice.get("finish_reason"):
            state.finish[i] = choice["finish_reason"]


def _json_problems(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return [f"structured output is not JSON ({e}): {text[:80]!r}"]
    if not isinstance(value, dict) or set(value) != {"label", "ok"} or value["label"] not in ("yes", "no", "unsure") \
            or not isinstance(value["ok"], bool):
        return [f"structured output does not match the schema: {text[:80]!r}"]
    return []
