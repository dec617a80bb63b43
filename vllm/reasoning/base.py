"""`ReasoningParser`: splitting a chat completion's text into reasoning and content.

What it owns: the contract every reasoning parser keeps (`--reasoning-parser NAME`),
the per-request streaming object (`ReasoningStream`) and the text scanning shared by
all formats. Parsers are pure functions of text: no tokenizer, no token ids, no
request object; the only per-request input besides the output is the rendered prompt
(to see whether the chat template opened or closed the reasoning block itself).

A parser is a small state machine over phases ("reasoning", "content", and
parser-specific ones such as "opening", where it has not yet seen whether the output
opens a reasoning block). `step()` consumes as much of the pending text as can be
decided and holds back the rest; `ReasoningStream` drives it and
`extract_reasoning()` is one stream fed the whole output, so streaming and
non-streaming cannot disagree.

Invariants:
- Streaming never emits marker text: a suffix that could be the start of a marker
  is held back until it is decided (or until `finish()`, which flushes it as text of
  the current phase; a partial marker at the very end is not a marker).
- For any split of the output into deltas, the concatenated streamed reasoning and
  content equal `extract_reasoning()`'s (None standing for "").
- Markers are only interpreted where the parser's docstring says; elsewhere (e.g.
  content after the end of reasoning) text is passed through verbatim. Whitespace
  is never stripped (as vLLM), except whitespace before an opening marker.
- A field is None when it has no characters (vLLM returns "" for an empty block).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, NamedTuple, Optional, Sequence

REASONING = "reasoning"
CONTENT = "content"


@dataclass(frozen=True)
class ReasoningDelta:
    """What one streamed delta adds to each field; None where it adds nothing."""

    reasoning: Optional[str] = None
    content: Optional[str] = None

    @property
    def is_empty(self) -> bool:
        return self.reasoning is None and self.content is None


class Step(NamedTuple):
    """Result of one `ReasoningParser.step`: text emitted to each field, how many
    characters of the pending text were consumed, and the phase to continue in."""

    reasoning: str
    content: str
    consumed: int
    phase: str


class ReasoningParser(ABC):
    """Base class. Subclasses set `name` and implement `initial_phase` and `step`.

    `step(phase, text, final)` must consume every character it does not hold back;
    it may hold back text only when `final` is False, and may return a different
    phase only after consuming (phases never cycle), which bounds the driver loop.
    """

    name: ClassVar[str] = ""

    def extract_reasoning(self, model_output: str,
                          prompt: Optional[str] = None) -> tuple[Optional[str], Optional[str]]:
        """(reasoning, content) of a complete output; `prompt` is the rendered prompt
        the output continues, when known."""
        stream = self.stream(prompt)
        first, last = stream.extract_streaming(model_output), stream.finish()
        reasoning = (first.reasoning or "") + (last.reasoning or "")
        content = (first.content or "") + (last.content or "")
        return reasoning or None, content or None

    def stream(self, prompt: Optional[str] = None) -> ReasoningStream:
        """A fresh streaming splitter for one request (one choice)."""
        return ReasoningStream(self, self.initial_phase(prompt))

    def is_content_phase(self, phase: str) -> bool:
        """Whether reasoning has ended once in `phase` (what follows is the answer)."""
        return phase == CONTENT

    @abstractmethod
    def initial_phase(self, prompt: Optional[str]) -> str:
        """The phase the output starts in, given the rendered prompt (None: unknown)."""

    @abstractmethod
    def step(self, phase: str, text: str, final: bool) -> Step:
        """Consume the decidable prefix of `text` (pending, not yet emitted) in `phase`."""


class ReasoningStream:
    """Per-request streaming state: feed text deltas, then call `finish()` once."""

    def __init__(self, parser: ReasoningParser, phase: str):
        self._parser = parser
        self._phase = phase
        self._pending = ""
        self._finished = False

    @property
    def phase(self) -> str:
        """The current phase (e.g. "content" once reasoning has ended)."""
        return self._phase

    @property
    def reasoning_ended(self) -> bool:
        """True once the output is past its reasoning (or never had any)."""
        return self._parser.is_content_phase(self._phase)

    def extract_streaming(self, delta_text: str) -> ReasoningDelta:
        """Classify `delta_text` (plus whatever was held back); returns what can be emitted now."""
        if self._finished:
            raise RuntimeError("extract_streaming() called after finish()")
        self._pending += delta_text
        return self._drain(final=False)

    def finish(self) -> ReasoningDelta:
        """End of output: flush held-back text (as text of the current phase)."""
        if self._finished:
            return ReasoningDelta()
        delta = self._drain(final=True)
        self._finished = True
        return delta

    def _drain(self, final: bool) -> ReasoningDelta:
        reasoning, content = [], []
        while True:
            step = self._parser.step(self._phase, self._pending, final)
            reasoning.append(step.reasoning)
            content.append(step.content)
            self._pending = self._pending[step.consumed:]
            moved, self._phase = step.phase != self._phase, step.phase
            if not moved:
                break
        if final and self._pending:  # a step broke its contract; never lose text
            raise AssertionError(f"{type(self._parser).__name__} left {self._pending!r} unconsumed")
        return ReasoningDelta("".join(reasoning) or None, "".join(content) or None)


# ---- text scanning shared by the parsers ------------------------------------------------


def find_first(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, Optional[str]]:
    """Earliest occurrence of any marker at or after `start` (longest on a tie)."""
    best, found = -1, None
    for marker in markers:
        idx = text.find(marker, start)
        if idx != -1 and (best == -1 or idx < best or (idx == best and len(marker) > len(found))):
            best, found = idx, marker
    return best, found


def partial_suffix_len(text: str, markers: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a marker."""
    longest = max((len(m) for m in markers), default=1) - 1
    for k in range(min(len(text), longest), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


def scan(text: str, stops: Sequence[str], drops: Sequence[str],
         final: bool) -> tuple[str, int, Optional[str]]:
    """Pass text through up to the first `stops` marker, deleting `drops` markers.

    Returns (emitted text, characters consumed including the stop marker, the stop
    marker or None). Without a stop marker, a suffix that could start a marker is
    left unconsumed unless `final`.
    """
    markers = tuple(stops) + tuple(drops)
    out, pos = [], 0
    while True:
        idx, marker = find_first(text, markers, pos)
        if marker is None:
            break
        out.append(text[pos:idx])
        pos = idx + len(marker)
        if marker in stops:
            return "".join(out), pos, marker
    end = len(text) if final else len(text) - partial_suffix_len(text[pos:], markers)
    out.append(text[pos:end])
    return "".join(out), end, None


def opening(text: str, markers: Sequence[str], final: bool) -> Optional[tuple[Optional[str], int]]:
    """Whether `text` opens with one of `markers` after optional whitespace.

    Returns (marker, characters consumed) when it does, (None, 0) when it cannot (or
    `final` leaves it undecided), and None while `text` could still grow into one.
    """
    body = text.lstrip()
    for marker in sorted(markers, key=len, reverse=True):
        if body.startswith(marker):
            return marker, len(text) - len(body) + len(marker)
    if not final and any(m.startswith(body) for m in markers):
        return None
    return None, 0


def prompt_tail(prompt: Optional[str]) -> Optional[str]:
    """The prompt without trailing whitespace (where the template's generation prompt ends)."""
    return None if prompt is None else prompt.rstrip()
