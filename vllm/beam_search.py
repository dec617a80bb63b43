"""Beam search as vLLM's `LLM.beam_search` runs it, with vLLM's names
(`BeamSearchSequence`, `BeamSearchOutput`, `BeamSearchInstance`, `get_beam_search_score`,
`create_sort_beams_key_function`).

The search is repeated one-token generate steps (`run_beam_search`): every live beam is
sent as a token prompt (prompt + its tokens so far) for one token with
`logprobs = 2 * beam_width`; every returned candidate (the top tokens and the sampled one)
extends its beam by that token. A candidate ending in a stop token (EOS or a
generation-config EOS, unless `ignore_eos`) is complete (`finish_reason="stop"`); the
others compete per prompt and the best `beam_width` by score live on. A beam that reaches
`max_model_len` is complete (`"length"`). After `max_tokens` steps (or when no beam is
live) completed and live beams are ranked together and the best `beam_width` returned,
best first. Prefix caching makes re-sending a beam cheap: only its last, partial block is
recomputed.

Invariants: `tokens` include the prompt, and the stop token that ended a beam (as in
vLLM); `logprobs` holds one dict per generated token; `cum_logprob` is the sum of the
chosen tokens' logprobs; score = cum_logprob / len(tokens, less a final stop token) **
length_penalty. `text` is `tokens` decoded, without the final stop token's text unless
`include_stop_str_in_output`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection, Optional, Sequence, Union

from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import CompletionOutput, Logprob, RequestOutput
from vllm.sampling_params import BeamSearchParams, SamplingParams

# Runs one batch of one-token requests: (prompts, params, per-prompt adapters) -> outputs in order.
GenerateStep = Callable[[list[TokensPrompt], SamplingParams, list[Optional[LoRARequest]]], list[RequestOutput]]


@dataclass
class BeamSearchSequence:
    """One beam: the prompt and generated tokens, and their log probability."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    lora_request: Optional[LoRARequest] = None
    cum_logprob: float = 0.0
    text: Optional[str] = None
    finish_reason: Optional[str] = None  # "stop" (a stop token) or "length"
    stop_reason: Union[int, str, None] = None


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (at most beam_width)."""

    sequences: list[BeamSearchSequence]


class BeamSearchInstance:
    """The search state of one prompt: live beams and completed ones."""

    def __init__(self, prompt_tokens: list[int], lora_request: Optional[LoRARequest] = None,
                 logprobs: Optional[list[dict[int, Logprob]]] = None):
        self.beams = [BeamSearchSequence(list(prompt_tokens), list(logprobs or []), lora_request)]
        self.completed: list[BeamSearchSequence] = []


def get_beam_search_score(tokens: list[int], cumulative_logprob: float, eos_token_id: Union[int, Collection[int]],
                          length_penalty: float = 1.0) -> float:
    """cumulative_logprob / length ** length_penalty, a final stop token not counted."""
    stops = {eos_token_id} if isinstance(eos_token_id, int) else eos_token_id
    seq_len = len(tokens) - (1 if tokens and tokens[-1] in stops else 0)
    return cumulative_logprob / (max(seq_len, 1) ** length_penalty)


def create_sort_beams_key_function(eos_token_id: Union[int, Collection[int]], length_penalty: float):
    def sort_beams_key(x: BeamSearchSequence) -> float:
        return get_beam_search_score(x.tokens, x.cum_logprob, eos_token_id, length_penalty)

    return sort_beams_key


def run_beam_search(step: GenerateStep, instances: Sequence[BeamSearchInstance], params: BeamSearchParams,
                    stop_ids: Collection[int], max_model_len: int, decode: Callable[[list[int]], str]
                    ) -> list[BeamSearchOutput]:
    stops = frozenset() if params.ignore_eos else frozenset(stop_ids)
    key = create_sort_beams_key_function(stops, params.length_penalty)
    sampling = SamplingParams(logprobs=2 * params.beam_width, max_tokens=1, temperature=params.temperature,
                              ignore_eos=True, detokenize=False)
    for _ in range(params.max_tokens):
        live = [(instance, beam) for instance in instances for beam in instance.beams]
        if not live:
            break
        outputs = step([TokensPrompt(prompt_token_ids=beam.tokens) for _, beam in live], sampling,
                       [beam.lora_request for _, beam in live])
        candidates: dict[int, list[BeamSearchSequence]] = {id(instance): [] for instance in instances}
        for (instance, beam), output in zip(live, outputs):
            candidates[id(instance)].extend(_extend(beam, output.outputs[0]))
        for instance in instances:
            _select(instance, candidates[id(instance)], params.beam_width, key, stops, max_model_len)
    return [_finish(instance, params, key, decode) for instance in instances]


def _extend(beam: BeamSearchSequence, completion: CompletionOutput) -> list[BeamSearchSequence]:
    """Every candidate next token of `beam` (none when the step returned no logprobs)."""
    if not completion.logprobs:
        return []
    top = completion.logprobs[0]
    return [
        BeamSearchSequence(beam.tokens + [token_id], beam.logprobs + [top], beam.lora_request,
                           beam.cum_logprob + logprob.logprob)
        for token_id, logprob in top.items()
    ]


def _select(instance: BeamSearchInstance, candidates: list[BeamSearchSequence], beam_width: int, key,
            stops: frozenset[int], max_model_len: int) -> None:
    """Stop-token candidates complete; the best `beam_width` others live on unless full."""
    live = []
    for beam in candidates:
        if beam.tokens[-1] in stops:
            beam.finish_reason = "stop"
            instance.completed.append(beam)
        else:
            live.append(beam)
    instance.beams = []
    for beam in sorted(live, key=key, reverse=True)[:beam_width]:
        if len(beam.tokens) >= max_model_len:
            beam.finish_reason = "length"
            instance.completed.append(beam)
        else:
            instance.beams.append(beam)


def _finish(instance: BeamSearchInstance, params: BeamSearchParams, key, decode) -> BeamSearchOutput:
    for beam in instance.beams:
        beam.finish_reason = "length"
    best = sorted(instance.completed + instance.beams, key=key, reverse=True)[: params.beam_width]
    for beam in best:
        drop_stop = beam.finish_reason == "stop" and not params.include_stop_str_in_output
        beam.text = decode(beam.tokens[:-1] if drop_stop else beam.tokens)
    return BeamSearchOutput(sequences=best)
