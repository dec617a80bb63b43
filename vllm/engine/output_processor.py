"""`OutputProcessor`: turns engine-core outputs into `RequestOutput`s.

It owns what the caller sees: detokenised text, stop strings (a request whose text
hits a stop string is reported finished and handed back for abort), logprobs as
`Logprob` dicts, and fan-in of `n > 1` children into one output. Output kinds:
CUMULATIVE carries everything so far, DELTA only what is new, FINAL_ONLY one
output at the end.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

from vllm.core.sched_output import EngineCoreOutput, LogprobsEntry
from vllm.engine.detokenizer import IncrementalDetokenizer
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.tokenizer import IdDecoder


@dataclass
class SequenceState:
    """One generated sequence (a child of its parent request)."""

    request_id: str
    index: int
    params: SamplingParams
    detokenizer: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    logprobs: Optional[list[dict[int, Logprob]]] = None
    cumulative_logprob: Optional[float] = None
    finish_reason: Optional[str] = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0
    sent_chars: int = 0


@dataclass
class ParentState:
    request_id: str
    prompt: Optional[str]
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: Optional[LoRARequest]
    children: list[SequenceState]
    metrics: RequestMetrics
    prompt_logprobs: Optional[list[Optional[dict[int, Logprob]]]] = None
    num_cached_tokens: int = 0

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, decode: IdDecoder):
        self.decode = decode
        self._token_texts: dict[int, str] = {}  # a logprob token's own text, by id (a pure function of it)
        self.parents: dict[str, ParentState] = {}
        self.child_to_parent: dict[str, tuple[ParentState, SequenceState]] = {}

    def add_request(self, parent: ParentState) -> None:
        self.parents[parent.request_id] = parent
        for child in parent.children:
            self.child_to_parent[child.request_id] = (parent, child)

    def has_unfinished_requests(self) -> bool:
        return bool(self.parents)

    def abort_requests(self, request_ids: list[str]) -> list[str]:
        """Forget parents; returns the child ids the engine core must abort."""
        child_ids = []
        for request_id in request_ids:
            parent = self.parents.pop(request_id, None)
            if parent is None:
                continue
            for child in parent.children:
                self.child_to_parent.pop(child.request_id, None)
                if child.finish_reason is None:
                    child_ids.append(child.request_id)
        return child_ids

    def process_outputs(self, outputs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Returns the outputs to hand to callers and child ids to abort (stop strings)."""
        now = time.time()
        touched: dict[str, ParentState] = {}
        to_abort: list[str] = []
        for out in outputs:
            entry = self.child_to_parent.get(out.request_id)
            if entry is None:
                continue
            parent, child = entry
            self._update_metrics(parent.metrics, out, now)
            parent.num_cached_tokens = out.num_cached_tokens
            if out.new_prompt_logprobs:
                self._add_prompt_logprobs(parent, out.new_prompt_logprobs)
            if self._update_child(child, out):
                to_abort.append(child.request_id)
            touched[parent.request_id] = parent

        results = []
        for parent in touched.values():
            result = self._make_output(parent)
            if result is not None:
                results.append(result)
            if parent.finished:
                self.parents.pop(parent.request_id, None)
                for child in parent.children:
                    self.child_to_parent.pop(child.request_id, None)
        return results, to_abort

    @staticmethod
    def _update_metrics(metrics: RequestMetrics, out: EngineCoreOutput, now: float) -> None:
        if out.new_token_ids and metrics.first_token_time is None:
            metrics.first_token_time = now
        if out.new_token_ids:
            metrics.last_token_time = now
        if out.finished:
            metrics.finished_time = now

    def _update_child(self, child: SequenceState, out: EngineCoreOutput) -> bool:
        """Returns True when a stop string finished the child (the core must abort it)."""
        if child.finish_reason is not None:
            return False
        params = child.params
        first_new = len(child.token_ids)
        check_stop = first_new + len(out.new_token_ids) >= params.min_tokens
        child.token_ids.extend(out.new_token_ids)
        if out.new_logprobs is not None:
            self._add_logprobs(child, out.new_logprobs)
        child.finish_reason, child.stop_reason = out.finish_reason, out.stop_reason
        if not params.detokenize:
            return False
        stop = child.detokenizer.update(out.new_token_ids, finished=out.finished, check_stop=check_stop)
        if stop is not None:
            # Tokens after the one that completed the stop string are dropped.
            del child.token_ids[len(child.detokenizer.token_texts) :]
            if child.logprobs is not None:
                del child.logprobs[len(child.token_ids) :]
            self._sync_logprob_texts(child, 0)
            was_finished = out.finished
            child.finish_reason, child.stop_reason = "stop", stop
            return not was_finished
        self._sync_logprob_texts(child, first_new)
        return False

    @staticmethod
    def _sync_logprob_texts(child: SequenceState, start: int) -> None:
        """The sampled token's text is what it added to the output text."""
        if child.logprobs is None:
            return
        texts = child.detokenizer.token_texts
        for i in range(start, min(len(child.logprobs), len(texts))):
            child.logprobs[i][child.token_ids[i]].decoded_token = texts[i]

    def _to_logprob_dict(self, entry: LogprobsEntry) -> dict[int, Logprob]:
        result: dict[int, Logprob] = {}
        for k, (token_id, value) in enumerate(zip(entry.token_ids, entry.logprobs)):
            if token_id not in result:
                text = self._token_texts.get(token_id)
                if text is None:
                    text = self._token_texts[token_id] = self.decode([token_id], False, True)
                result[token_id] = Logprob(value, entry.rank if k == 0 else k, text)
        return result

    def _add_logprobs(self, child: SequenceState, entries: list[LogprobsEntry]) -> None:
        if child.logprobs is None:
            child.logprobs, child.cumulative_logprob = [], 0.0
        for entry in entries:
            child.logprobs.append(self._to_logprob_dict(entry))
            child.cumulative_logprob += entry.logprobs[0]

    def _add_prompt_logprobs(self, parent: ParentState, entries: list[LogprobsEntry]) -> None:
        if parent.prompt_logprobs is None:
            parent.prompt_logprobs = [None]
        for entry in entries:
            parent.prompt_logprobs.append(self._to_logprob_dict(entry))

    def _make_output(self, parent: ParentState) -> Optional[RequestOutput]:
        kind = parent.params.output_kind
        if kind == RequestOutputKind.FINAL_ONLY and not parent.finished:
            return None
        completions = [self._completion(parent, c, delta=kind == RequestOutputKind.DELTA) for c in parent.children]
        if kind == RequestOutputKind.DELTA:
            completions = [c for c in completions if c is not None]
            if not completions and not parent.finished:
                return None  # nothing visible yet (held back for a possible stop string)
        return RequestOutput(
            request_id=parent.request_id,
            prompt=parent.prompt,
            prompt_token_ids=parent.prompt_token_ids,
            prompt_logprobs=parent.prompt_logprobs,
            outputs=completions,
            finished=parent.finished,
            metrics=parent.metrics,
            lora_request=parent.lora_request,
            num_cached_tokens=parent.num_cached_tokens,
        )

    @staticmethod
    def _sendable(child: SequenceState, finished: bool) -> tuple[int, int]:
        """(tokens, characters) a DELTA output may carry so far. Text a stop string
        could still cut is held back, and with it every token whose text is not fully
        visible, so each delta's token texts concatenate exactly to its text."""
        detok = child.detokenizer
        if finished or not child.params.detokenize:
            return len(child.token_ids), len(detok.text)
        limit = len(detok.text) - detok.stop_holdback
        tokens, chars = child.sent_tokens, child.sent_chars
        while tokens < len(detok.token_texts) and chars + len(detok.token_texts[tokens]) <= limit:
            chars += len(detok.token_texts[tokens])
            tokens += 1
        return tokens, chars

    def _completion(self, parent: ParentState, child: SequenceState, delta: bool) -> Optional[CompletionOutput]:
        text, token_texts = child.detokenizer.text, child.detokenizer.token_texts
        token_ids, logprobs = child.token_ids, child.logprobs
        if delta:
            finished = child.finish_reason is not None
            num_tokens, visible = self._sendable(child, finished)
            if num_tokens == child.sent_tokens and visible == child.sent_chars and not finished:
                return None
            start_tok, start_chr = child.sent_tokens, child.sent_chars
            child.sent_tokens, child.sent_chars = num_tokens, visible
            text, token_ids = text[start_chr:visible], token_ids[start_tok:num_tokens]
            token_texts = token_texts[start_tok:num_tokens]
            logprobs = logprobs[start_tok:num_tokens] if logprobs is not None else None
        return CompletionOutput(
            index=child.index,
            text=text,
            token_ids=list(token_ids),
            cumulative_logprob=child.cumulative_logprob,
            logprobs=list(logprobs) if logprobs is not None else None,
            finish_reason=child.finish_reason,
            stop_reason=child.stop_reason,
            lora_request=parent.lora_request,
            token_texts=list(token_texts),
        )
