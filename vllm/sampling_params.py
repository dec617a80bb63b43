"""Sampling parameters of one request, with vLLM's names, defaults and validation, and
`BeamSearchParams` of `LLM.beam_search`.

Invariants after construction: every numeric field has its type, is finite and is
within its allowed range (a ValueError names the field and what is allowed otherwise:
never a TypeError, whatever the arguments), `logit_bias` maps int token ids to finite
floats, `stop` is a list of
strings, `stop_token_ids` a list of ints, `top_k` is 0 when disabled (vLLM also
accepts -1 for that), and a temperature below `_GREEDY_EPS` means greedy.
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Optional, Union

_GREEDY_EPS = 1e-5
_SEED_LIMIT = 2**63
_INT_FIELDS = ("n", "top_k", "min_tokens")
_OPTIONAL_INT_FIELDS = ("seed", "max_tokens", "logprobs", "prompt_logprobs")
_FLOAT_FIELDS = ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature", "top_p", "min_p")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _logit_bias(bias: dict) -> dict[int, float]:
    """Token id -> finite bias; keys may be ints or their decimal strings (OpenAI sends strings)."""
    result = {}
    for key, value in bias.items():
        try:
            token = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"logit_bias keys must be token ids, got {key!r}.") from None
        if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
            raise ValueError(f"logit_bias values must be finite numbers, got {value!r} for token {key!r}.")
        result[token] = float(value)
    return result


class RequestOutputKind(IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new
    FINAL_ONLY = 2  # one output, when the request finishes


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class StructuredOutputsParams:
    """Exactly one of json, regex, choice, grammar or json_object constrains the output."""

    json: Optional[Union[str, dict]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    disable_any_whitespace: bool = False

    def __post_init__(self) -> None:
        kinds = [k for k in ("json", "regex", "choice", "grammar", "json_object") if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of 'json', 'regex', 'choice', 'grammar', "
                f"'json_object'; got {kinds or 'none'}."
            )
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(isinstance(c, str) for c in self.choice):
                raise ValueError(f"structured_outputs.choice must be a non-empty list of strings, got {self.choice!r}.")

    @property
    def kind(self) -> str:
        for k in ("json", "regex", "choice", "grammar", "json_object"):
            if getattr(self, k) not in (None, False):
                return k
        raise AssertionError("validated in __post_init__")


@dataclass
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    max_tokens: Optional[int] = 16
    min_tokens: int = 0
    logprobs: Optional[int] = None
    prompt_logprobs: Optional[int] = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: Optional[dict[int, float]] = None
    allowed_token_ids: Optional[list[int]] = None
    # Words the output must not contain: each one's last token is banned wherever the output so
    # far ends with the rest of it (as vLLM's bad_words, with and without a leading space).
    bad_words: Optional[list[str]] = None
    structured_outputs: Optional[StructuredOutputsParams] = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    extra_args: Optional[dict[str, Any]] = None
    # Filled in by the processor from the model's generation config / tokenizer.
    all_stop_token_ids: set[int] = field(default_factory=set, repr=False)
    eos_token_id: Optional[int] = field(default=None, repr=False)
    bad_words_token_ids: list[list[int]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        # Types first, so a wrong one is a ValueError naming the field, never a TypeError
        # from a comparison or conversion below.
        self._check_types()
        if self.stop is None:
            self.stop = []
        elif isinstance(self.stop, str):
            self.stop = [self.stop]
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            self.logit_bias = _logit_bias(self.logit_bias)
        self._verify()
        if self.temperature < _GREEDY_EPS:
            # Greedy: the other sampling knobs have no effect, as in vLLM.
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_types(self) -> None:
        for name in _INT_FIELDS + _OPTIONAL_INT_FIELDS:
            value = getattr(self, name)
            if not _is_int(value) and not (value is None and name in _OPTIONAL_INT_FIELDS):
                raise ValueError(f"{name} must be an integer, got {value!r}.")
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not (_is_int(value) or isinstance(value, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}.")
        for name in ("stop_token_ids", "allowed_token_ids"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, (list, tuple)) or not all(_is_int(t) for t in value)):
                raise ValueError(f"{name} must be a list of integers, got {value!r}.")
        if self.stop is not None and not isinstance(self.stop, (str, list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}.")
        if self.bad_words is not None and (not isinstance(self.bad_words, (list, tuple))
                                           or not all(isinstance(w, str) for w in self.bad_words)):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}.")
        if self.logit_bias is not None and not isinstance(self.logit_bias, dict):
            raise ValueError(f"logit_bias must be a mapping of token id to bias, got {self.logit_bias!r}.")
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError(f"structured_outputs must be a StructuredOutputsParams, got {self.structured_outputs!r}.")
        if not isinstance(self.output_kind, RequestOutputKind):
            raise ValueError(f"output_kind must be a RequestOutputKind, got {self.output_kind!r}.")
        if self.extra_args is not None and not isinstance(self.extra_args, dict):
            raise ValueError(f"extra_args must be a dict, got {self.extra_args!r}.")

    def _verify(self) -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ValueError(message)

        check(self.n >= 1, f"n must be at least 1, got {self.n}.")
        check(-2.0 <= self.presence_penalty <= 2.0, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        check(-2.0 <= self.frequency_penalty <= 2.0, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        check(0.0 < self.repetition_penalty <= 2.0, f"repetition_penalty must be in (0, 2], got {self.repetition_penalty}.")
        check(self.temperature >= 0.0, f"temperature must be non-negative, got {self.temperature}.")
        check(0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}.")
        check(self.top_k >= 0, f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.")
        check(0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}.")
        if self.max_tokens is not None:
            check(self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}.")
        check(self.min_tokens >= 0, f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None:
            check(
                self.min_tokens <= self.max_tokens,
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}.",
            )
        if self.logprobs is not None:
            check(self.logprobs >= 0, f"logprobs must be non-negative, got {self.logprobs}.")
        if self.prompt_logprobs is not None:
            check(self.prompt_logprobs >= 0, f"prompt_logprobs must be non-negative, got {self.prompt_logprobs}.")
        if self.seed is not None:
            # The sampler seeds a torch.Generator, which takes 64-bit seeds (n > 1 children add their index).
            check(-_SEED_LIMIT <= self.seed < _SEED_LIMIT, f"seed must be in [-2**63, 2**63), got {self.seed}.")
        check(all(isinstance(s, str) and s for s in self.stop), f"stop must be a list of non-empty strings, got {self.stop!r}.")
        check(
            all(t >= 0 for t in self.stop_token_ids),
            f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}.",
        )
        if self.allowed_token_ids is not None:
            check(len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty.")
            check(all(t >= 0 for t in self.allowed_token_ids),
                  f"allowed_token_ids must be non-negative integers, got {self.allowed_token_ids!r}.")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    def clone(self) -> "SamplingParams":
        return copy.deepcopy(self)

    def update_from_tokenizer(self, eos_token_id: Optional[int], generation_eos_ids: set[int]) -> None:
        """Record which tokens end generation (EOS and stop_token_ids)."""
        self.eos_token_id = eos_token_id
        stops = set(self.stop_token_ids)
        if not self.ignore_eos:
            stops |= generation_eos_ids
            if eos_token_id is not None:
                stops.add(eos_token_id)
        self.all_stop_token_ids = stops

    def update_bad_words(self, encode) -> None:
        """Token sequences of `bad_words`: each word alone and after a space (`encode`: text -> ids)."""
        sequences: list[list[int]] = []
        for word in self.bad_words or []:
            if not isinstance(word, str) or not word.strip():
                raise ValueError(f"bad_words must be non-empty strings, got {word!r}.")
            for text in (word, " " + word.lstrip()):
                ids = encode(text)
                if ids and ids not in sequences:
                    sequences.append(ids)
        self.bad_words_token_ids = sequences

    def verify_against_vocab(self, vocab_size: int) -> None:
        for name, ids in (
            ("stop_token_ids", self.stop_token_ids),
            ("allowed_token_ids", self.allowed_token_ids or []),
            ("logit_bias", list(self.logit_bias or {})),
        ):
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} contains token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}.")
        if self.top_k >= vocab_size:
            # Keeping the vocab_size most likely tokens keeps them all: the same as no top-k
            # (and the sampler's topk cannot take more than the vocabulary).
            self.top_k = 0


@dataclass
class BeamSearchParams:
    """Parameters of `LLM.beam_search` (vLLM's names and defaults): keep the `beam_width`
    best sequences by cumulative logprob (divided by length ** `length_penalty`) for up to
    `max_tokens` tokens. `temperature` is that of each one-token step (0: greedy)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be at least 1, got {self.beam_width!r}.")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}.")
        if self.temperature < 0.0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
