"""Compiling a request's structured-output spec into an xgrammar grammar, with a cache.

What it owns: turning `StructuredOutputsParams` into an `xgrammar.CompiledGrammar`, the
error messages for specs that cannot be compiled, and the compile cache.

Invariants:
- Every spec problem surfaces as a `ValueError` whose message names the field and the
  problem (xgrammar's own messages, with its C++ file/line prefix removed).
- The cache key is (kind, canonical spec, whitespace mode). The canonical JSON keeps key
  order: xgrammar emits object properties in the schema's declared order, so two schemas
  that differ only in property order are different grammars.
- A spec is compiled at most once while it stays cached, even when several threads (the
  HTTP thread validating, the engine thread building matchers) ask for it at once; later
  callers wait for the first compile. Spec errors are cached too, so a bad spec sent again
  costs a dictionary lookup. Any other compile failure (not a ValueError: a bug or a
  resource failure) is a RuntimeError (HTTP 500) for the requests waiting on that compile
  and is not cached: the next request compiles again.
- The matching itself is xgrammar's: this module never inspects generated text.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Optional

import xgrammar as xgr

from vllm import fault_injection
from vllm.sampling_params import StructuredOutputsParams

# xgrammar's errors start with "[hh:mm:ss] /path/file.cc:123: " and sometimes a failed
# check's expression; neither helps a client fix its request.
_XGR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*(Check failed: \(.*?\) is false:\s*)?")

# What `{"json_object": true}` means: any JSON object, as in vLLM.
_ANY_OBJECT_SCHEMA = '{"type": "object"}'


def _clean_error(err: BaseException) -> str:
    # The first line carries the message (and its position); later lines only echo the input.
    lines = [line for line in str(err).strip().splitlines() if line.strip()]
    return _XGR_PREFIX.sub("", lines[0])[:500] if lines else type(err).__name__


def _find_remote_refs(node: Any) -> list[str]:
    """The `$ref` values that do not point into the schema itself.

    xgrammar silently treats a `$ref` it cannot follow (e.g. an URL) as "any JSON", which
    would leave the request unconstrained; we reject such schemas instead.
    """
    found: list[str] = []
    stack = [node]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            ref = item.get("$ref")
            if isinstance(ref, str) and not ref.startswith("#"):
                found.append(ref)
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _json_schema_text(schema: Any) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"structured_outputs.json is not valid JSON: {e}.") from None
    if not isinstance(schema, dict):
        raise ValueError(
            f"structured_outputs.json must be a JSON schema object (a dict or its JSON text), "
            f"got {type(schema).__name__}: {str(schema)[:100]!r}."
        )
    remote = _find_remote_refs(schema)
    if remote:
        raise ValueError(
            f"structured_outputs.json has a $ref that is not local to the schema: {remote[0]!r}; "
            "only references of the form '#/$defs/Name' are supported."
        )
    try:
        return json.dumps(schema, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:
        raise ValueError(f"structured_outputs.json cannot be serialized as JSON: {e}.") from None


def _choice_ebnf(choices: list[str]) -> str:
    # json.dumps escapes quotes, backslashes and control characters the way xgrammar's EBNF
    # string literals expect; ensure_ascii=False keeps non-BMP characters whole (no
    # surrogate pairs, which EBNF literals do not combine).
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


@dataclass(frozen=True)
class GrammarSpec:
    """A request's constraint in canonical form: what the cache is keyed by."""

    kind: str  # "json" | "json_object" | "regex" | "choice" | "grammar" | "lark"
    text: str
    any_whitespace: bool

    @classmethod
    def from_params(cls, params: StructuredOutputsParams) -> "GrammarSpec":
        kind = params.kind
        any_ws = not params.disable_any_whitespace
        if kind == "json":
            return cls("json", _json_schema_text(params.json), any_ws)
        if kind == "json_object":
            return cls("json_object", _ANY_OBJECT_SCHEMA, any_ws)
        if kind == "regex":
            if not isinstance(params.regex, str) or not params.regex:
                raise ValueError(f"structured_outputs.regex must be a non-empty string, got {params.regex!r}.")
            return cls("regex", params.regex, any_ws)
        if kind == "choice":
            return cls("choice", _choice_ebnf(params.choice), any_ws)
        grammar = params.grammar
        if not isinstance(grammar, str) or not grammar.strip():
            raise ValueError(f"structured_outputs.grammar must be a non-empty string, got {grammar!r}.")
        # vLLM's rule: a grammar with "::=" rules is EBNF/GBNF, anything else is Lark.
        return cls("grammar" if "::=" in grammar else "lark", grammar, any_ws)

    def compile(self, compiler: xgr.GrammarCompiler) -> xgr.CompiledGrammar:
        fault_injection.on_grammar_compile(self.text)
        try:
            if self.kind in ("json", "json_object"):
                return compiler.compile_json_schema(self.text, any_whitespace=self.any_whitespace)
            if self.kind == "regex":
                return compiler.compile_regex(self.text)
            if self.kind == "lark":
                return compiler.compile_lark(self.text)
            return compiler.compile_grammar(self.text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise ValueError(f"{self._describe()}: {_clean_error(e)}") from None

    def _describe(self) -> str:
        return {
            "json": "Invalid JSON schema in structured_outputs.json",
            "json_object": "Cannot compile structured_outputs.json_object",
            "regex": "Invalid or unsupported regex in structured_outputs.regex",
            "choice": "Cannot compile structured_outputs.choice",
            "grammar": "Invalid EBNF grammar in structured_outputs.grammar",
            "lark": "Invalid Lark grammar in structured_outputs.grammar (EBNF grammars use '::=')",
        }[self.kind]


@dataclass
class _Entry:
    ready: threading.Event = field(default_factory=threading.Event)
    compiled: Optional[xgr.CompiledGrammar] = None
    error: Optional[str] = None  # the spec is bad (ValueError, cached)
    failure: Optional[BaseException] = None  # the compile itself broke (not cached)


class GrammarCache:
    """Thread-safe LRU of compiled grammars (and compile errors) keyed by `GrammarSpec`."""

    def __init__(self, compiler: xgr.GrammarCompiler, max_entries: int = 256) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, got {max_entries}.")
        self._compiler = compiler
        self._max_entries = max_entries
        self._entries: OrderedDict[GrammarSpec, _Entry] = OrderedDict()
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0  # the number of compiles

    def get(self, params: StructuredOutputsParams) -> xgr.CompiledGrammar:
        spec = GrammarSpec.from_params(params)
        with self._lock:
            entry = self._entries.get(spec)
            owner = entry is None
            if owner:
                entry = self._entries[spec] = _Entry()
                self.misses += 1
                while len(self._entries) > self._max_entries:
                    # Whoever still waits on an evicted entry holds its own reference.
                    self._entries.popitem(last=False)
            else:
                self._entries.move_to_end(spec)
                self.hits += 1
        if owner:
            # Compile outside the lock: a large schema must not block other specs.
            try:
                entry.compiled = spec.compile(self._compiler)
            except ValueError as e:
                entry.error = str(e)
            except Exception as e:  # noqa: BLE001 - waiters must never see a half-made entry
                entry.failure = e
                self._forget(spec, entry)
            finally:
                entry.ready.set()
        else:
            entry.ready.wait()
        if entry.failure is not None:
            # Not the client's fault (a bug, a resource failure): a server error, for this request only.
            raise RuntimeError(f"Grammar compilation failed: {entry.failure!r}") from entry.failure
        if entry.error is not None:
            # A fresh exception each time: a shared one would pile up tracebacks.
            raise ValueError(entry.error)
        return entry.compiled

    def _forget(self, spec: GrammarSpec, entry: _Entry) -> None:
        with self._lock:
            if self._entries.get(spec) is entry:
                del self._entries[spec]

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
