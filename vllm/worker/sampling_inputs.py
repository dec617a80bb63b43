"""Builds the sampler's row-wise tensors from the requests that sample this step.

Expensive pieces (penalty count matrices, top-k/top-p/min-p tensors) are only built
when some row uses them, so a plain greedy batch costs almost nothing here.
"""

from __future__ import annotations

import torch

from vllm.model_executor.layers.sampler import SamplingMetadata
from vllm.sampling_params import SamplingType
from vllm.worker.input_batch import CachedRequestState


def build_sampling_metadata(rows: list[CachedRequestState], vocab_size: int, device: torch.device) -> SamplingMetadata:
    params = [s.sampling_params for s in rows]
    temperature = torch.tensor([p.temperature if p.sampling_type != SamplingType.GREEDY else 0.0 for p in params],
                               dtype=torch.float32, device=device)
    all_greedy = all(p.sampling_type == SamplingType.GREEDY for p in params)
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    meta = SamplingMetadata(
        temperature=temperature,
        top_p=_optional([p.top_p for p in params], 1.0, torch.float32, device),
        top_k=_optional([p.top_k if p.top_k > 0 else vocab_size for p in params], vocab_size, torch.int64, device),
        min_p=_optional([p.min_p for p in params], 0.0, torch.float32, device),
        all_greedy=all_greedy,
        generators={j: s.generator for j, s in enumerate(rows) if s.generator is not None},
        max_num_logprobs=max(wanted) if wanted else None,
    )
    for j, (state, p) in enumerate(zip(rows, params)):
        if p.min_tokens or p.bad_words_token_ids:  # most rows have neither: no set built per row and step
            num_outputs = len(state.token_ids) - state.num_prompt_tokens
            banned = set(p.all_stop_token_ids) if num_outputs < p.min_tokens else set()
            if p.bad_words_token_ids:  # only then is the output so far needed
                banned |= _bad_word_endings(p.bad_words_token_ids, state.output_token_ids)
            if banned:
                meta.banned_tokens[j] = sorted(banned)
        if p.logit_bias:
            meta.logit_bias[j] = p.logit_bias
        if p.allowed_token_ids:
            meta.allowed_token_ids[j] = list(p.allowed_token_ids)
    if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in params):
        _add_penalties(meta, rows, vocab_size, device)
    return meta


def _bad_word_endings(sequences: list[list[int]], outputs: list[int]) -> set[int]:
    """The last token of every bad-word sequence whose other tokens end the output so far."""
    endings = set()
    for seq in sequences:
        prefix = seq[:-1]
        if not prefix or (len(outputs) >= len(prefix) and outputs[len(outputs) - len(prefix):] == prefix):
            endings.add(seq[-1])
    return endings


def _optional(values: list, neutral, dtype: torch.dtype, device: torch.device):
    if all(v == neutral for v in values):
        return None
    return torch.tensor(values, dtype=dtype, device=device)


def _add_penalties(meta: SamplingMetadata, rows: list[CachedRequestState], vocab_size: int, device: torch.device) -> None:
    counts = torch.zeros((len(rows), vocab_size), dtype=torch.float32, device=device)
    prompt_mask = torch.zeros((len(rows), vocab_size), dtype=torch.bool, device=device)
    for j, state in enumerate(rows):
        outputs = state.output_token_ids
        if outputs:
            ids = torch.tensor(outputs, device=device)
            counts[j].index_add_(0, ids, torch.ones(len(outputs), device=device))
        prompt_mask[j, torch.tensor(state.token_ids[: state.num_prompt_tokens], device=device)] = True
    params = [s.sampling_params for s in rows]
    meta.output_token_counts = counts
    meta.prompt_token_mask = prompt_mask
    meta.presence_penalties = torch.tensor([p.presence_penalty for p in params], device=device)
    meta.frequency_penalties = torch.tensor([p.frequency_penalty for p in params], device=device)
    meta.repetition_penalties = torch.tensor([p.repetition_penalty for p in params], device=device)
