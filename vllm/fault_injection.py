"""Test-only fault injection: make chosen operations fail on purpose, to prove the engine
survives them. Nothing here runs unless `VLLM_FAULT_INJECTION` is set.

`VLLM_FAULT_INJECTION` is a comma-separated list of `kind=value` entries (a kind may
repeat; values cannot contain commas):

- `step=N`: the model runner's N-th model step raises `InjectedFault`. Steps count from 1
  per engine and only those that run scheduled requests (start-up profiling and empty steps
  do not count). The engine fails the requests that step scheduled and goes on.
- `step_fatal=N`: the N-th step raises `InjectedFatalFault`, a `BaseException`, as an error
  nothing in the engine can recover from: the step loop stops and `AsyncLLM` is dead
  (`check_health` raises `EngineDeadError`, every request in flight or later fails).
- `adapter_load=NAME`: loading the LoRA adapter named NAME raises `InjectedFault` after half
  of its tensors were mapped onto the model (a partial load).
- `tokenizer=TEXT`: tokenizing a prompt that contains TEXT raises `InjectedFault`.
- `grammar=TEXT`: compiling a structured-output grammar whose (canonical) spec text
  contains TEXT raises `InjectedFault`.

`InjectedFault` is deliberately not a `ValueError`: it stands for a bug or a resource
failure, which must answer 500 (the server's error for engine-side failures), never the 400
of a validation error.

Invariants:
- The variable is read at every check, so a test can set or clear it while an engine runs
  (e.g. to load an adapter again once its fault is cleared); the text is parsed only when it
  changes, so a check costs an environment lookup and a string comparison.
- An invalid spec is a `ValueError` naming the entry and the allowed kinds; the model
  runner parses it at start-up (`check_spec`), so a typo fails the launch, not a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vllm import envs

KINDS = ("step", "step_fatal", "adapter_load", "tokenizer", "grammar")
_NUMERIC = ("step", "step_fatal")


class InjectedFault(Exception):
    """A failure injected through VLLM_FAULT_INJECTION (recoverable: one operation fails)."""


class InjectedFatalFault(BaseException):
    """An injected failure the engine must not recover from.

    A `BaseException` so that no `except Exception` recovery path can swallow it: it ends the
    engine loop the way an unrecoverable device or runtime failure would.
    """


@dataclass(frozen=True)
class FaultPlan:
    """The parsed faults: which steps fail (and how), which adapters and texts."""

    steps: frozenset[int] = frozenset()
    fatal_steps: frozenset[int] = frozenset()
    adapters: frozenset[str] = frozenset()
    tokenizer_texts: tuple[str, ...] = ()
    grammar_texts: tuple[str, ...] = ()


_NO_FAULTS = FaultPlan()


def parse(spec: Optional[str]) -> FaultPlan:
    """The plan of a VLLM_FAULT_INJECTION value; ValueError naming a bad entry."""
    if not spec or not spec.strip():
        return _NO_FAULTS
    values: dict[str, list] = {kind: [] for kind in KINDS}
    for entry in spec.split(","):
        entry = entry.strip()
        if not entry:
            continue  # a trailing comma
        kind, sep, value = entry.partition("=")
        kind = kind.strip()
        if not sep or kind not in KINDS:
            raise ValueError(
                f"VLLM_FAULT_INJECTION: invalid entry {entry!r}: expected kind=value with kind one of "
                f"{', '.join(KINDS)} (e.g. 'step=3,tokenizer=BOOM')."
            )
        if kind in _NUMERIC:
            try:
                number = int(value)
            except ValueError:
                number = 0
            if number < 1:
                raise ValueError(
                    f"VLLM_FAULT_INJECTION: invalid entry {entry!r}: {kind} needs a step number >= 1 "
                    f"(allowed kinds: {', '.join(KINDS)})."
                )
            values[kind].append(number)
        else:
            if not value:
                raise ValueError(
                    f"VLLM_FAULT_INJECTION: invalid entry {entry!r}: {kind} needs a non-empty value "
                    f"(allowed kinds: {', '.join(KINDS)})."
                )
            values[kind].append(value)
    return FaultPlan(
        steps=frozenset(values["step"]),
        fatal_steps=frozenset(values["step_fatal"]),
        adapters=frozenset(values["adapter_load"]),
        tokenizer_texts=tuple(values["tokenizer"]),
        grammar_texts=tuple(values["grammar"]),
    )


# (the variable's text, its plan): re-parsed only when the text changes.
_parsed: tuple[Optional[str], FaultPlan] = (None, _NO_FAULTS)


def current_plan() -> FaultPlan:
    """The faults VLLM_FAULT_INJECTION asks for now."""
    global _parsed
    spec = envs.VLLM_FAULT_INJECTION
    if not spec:
        return _NO_FAULTS
    cached_spec, plan = _parsed
    if spec != cached_spec:
        plan = parse(spec)
        _parsed = (spec, plan)  # one tuple assignment: readers on other threads see old or new
    return plan


def check_spec() -> None:
    """Parse the variable now (start-up), raising ValueError if it is invalid."""
    current_plan()


# ------------------------------------------------------------------ hooks
def on_model_step(step_number: int) -> None:
    """Called by the model runner before its `step_number`-th model step (1-based)."""
    plan = current_plan()
    if step_number in plan.fatal_steps:
        raise InjectedFatalFault(f"Injected fatal fault at model step {step_number} "
                                 f"(VLLM_FAULT_INJECTION step_fatal={step_number}).")
    if step_number in plan.steps:
        raise InjectedFault(f"Injected fault at model step {step_number} (VLLM_FAULT_INJECTION step={step_number}).")


def on_adapter_tensor(adapter_name: str, index: int, num_tensors: int) -> None:
    """Called before mapping tensor `index` of `num_tensors` of an adapter being loaded."""
    if index == num_tensors // 2 and adapter_name in current_plan().adapters:
        raise InjectedFault(f"Injected fault while loading LoRA adapter {adapter_name!r} after {index} of "
                            f"{num_tensors} tensors (VLLM_FAULT_INJECTION adapter_load={adapter_name}).")


def on_tokenize(text: object) -> None:
    """Called with a prompt's text (anything else is ignored) before it is tokenised, or
    before its given token ids are accepted."""
    if isinstance(text, str) and text:
        _raise_if_contains(text, current_plan().tokenizer_texts, "tokenizer", "tokenizing the prompt")


def on_grammar_compile(spec_text: str) -> None:
    """Called before a structured-output spec (its canonical text) is compiled."""
    _raise_if_contains(spec_text, current_plan().grammar_texts, "grammar", "compiling the structured-output grammar")


def _raise_if_contains(text: str, needles: tuple[str, ...], kind: str, what: str) -> None:
    for needle in needles:
        if needle in text:
            raise InjectedFault(f"Injected fault while {what} (VLLM_FAULT_INJECTION {kind}={needle}).")
