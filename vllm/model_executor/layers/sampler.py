"""`Sampler`: from one logits row per sampling request to the next token, plus logprobs.

Order of operations (as vLLM's): logprobs are taken from the logits the sampler
receives (after a structured-output mask, before anything else); then allowed-token
and min-tokens masks, logit bias, penalties; greedy rows take the argmax; the others
apply temperature, min-p, top-k and top-p and draw with the exponential-race trick
(argmax of p / q, q ~ Exp(1)), which lets seeded rows use their own generator.
All row-wise parameters are tensors, so a batch is a handful of ops.

q is drawn as -log(U), U ~ Uniform[0, 1) (an exact Exp(1) draw; U = 0 gives q = inf, a token
that cannot win, with probability 2^-24 per entry): on the CPU torch's `exponential_` costs
about 24 ns per entry, 75 ms for a batch of 64 rows over a 49k vocabulary, while `uniform_`
and `log_` together cost about a fifth of that.

Both argmaxes run in vllm/csrc/cpu/argmax.cpp on the CPU (torch.argmax's result, vectorized:
torch's walks a row one element at a time, ~75 us per 49k-token row).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from vllm import envs, native_build
from vllm.core.sched_output import LogprobsEntry


def native_argmax_unavailable_reason() -> Optional[str]:
    """Builds (first time on this machine) or loads the argmax kernel. None on success, else
    why not (also logged once as a warning)."""
    return native_build.unavailable_reason("argmax.cpp", "CPU argmax kernel")


def argmax_rows(logits: torch.Tensor, native: bool) -> torch.Tensor:
    """logits.argmax(dim=-1) of [N, V] logits: the native kernel where `native` and the logits
    are contiguous fp32 on the CPU, else torch's."""
    cpu_rows = logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
    if native and cpu_rows and logits.is_contiguous() and logits.shape[1] > 0:
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        torch.ops.vllm_sampling.argmax_rows(out, logits)
        return out
    return logits.argmax(dim=-1)


@dataclass
class SamplingMetadata:
    temperature: torch.Tensor  # [N] float, 0 for greedy rows
    top_p: Optional[torch.Tensor]  # [N] or None when no row uses it
    top_k: Optional[torch.Tensor]  # [N] long, vocab size for "off"
    min_p: Optional[torch.Tensor]  # [N]
    all_greedy: bool
    generators: dict[int, torch.Generator]  # row -> generator of seeded requests
    max_num_logprobs: Optional[int]  # None: no row wants logprobs
    # Penalties: output token counts [N, V] and prompt-token presence [N, V].
    presence_penalties: Optional[torch.Tensor] = None
    frequency_penalties: Optional[torch.Tensor] = None
    repetition_penalties: Optional[torch.Tensor] = None
    output_token_counts: Optional[torch.Tensor] = None
    prompt_token_mask: Optional[torch.Tensor] = None
    # Row -> token ids to forbid (min_tokens not reached: stop tokens).
    banned_tokens: dict[int, list[int]] = field(default_factory=dict)
    # Row -> {token: bias}; row -> allowed ids.
    logit_bias: dict[int, dict[int, float]] = field(default_factory=dict)
    allowed_token_ids: dict[int, list[int]] = field(default_factory=dict)


class Sampler:
    def __init__(self, device: torch.device):
        # Built (or loaded) with the model runner, not by the first request.
        self.native = (device.type == "cpu" and not envs.VLLM_USE_TORCH_REFERENCE_OPS
                       and native_argmax_unavailable_reason() is None)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> tuple[torch.Tensor, Optional[list[LogprobsEntry]]]:
        """logits: [N, V] float32. Returns sampled ids [N] and, if asked, one entry per row."""
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        logits = self._apply_constraints(logits, meta)
        logits = self._apply_penalties(logits, meta)
        if meta.all_greedy:
            sampled = argmax_rows(logits, self.native)
        else:
            sampled = self._sample(logits, meta)
        entries = None
        if raw_logprobs is not None:
            entries = gather_logprobs(raw_logprobs, sampled, meta.max_num_logprobs)
        return sampled, entries

    @staticmethod
    def _apply_constraints(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if not (meta.banned_tokens or meta.logit_bias or meta.allowed_token_ids):
            return logits
        original = logits
        logits = logits.clone()
        for row, allowed in meta.allowed_token_ids.items():
            keep = logits[row, allowed].clone()
            logits[row] = float("-inf")
            logits[row, allowed] = keep
        for row, bias in meta.logit_bias.items():
            ids = torch.tensor(list(bias), device=logits.device)
            logits[row, ids] += torch.tensor(list(bias.values()), device=logits.device, dtype=logits.dtype)
        for row, banned in meta.banned_tokens.items():
            logits[row, banned] = float("-inf")
        # A row these masks emptied (e.g. min_tokens banning the only token a grammar
        # allows) keeps its unmasked logits rather than sampling from nothing.
        dead = torch.isneginf(logits).all(dim=-1)
        if bool(dead.any()):
            logits[dead] = original[dead]
        return logits

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        if meta.output_token_counts is None:
            return logits
        counts = meta.output_token_counts
        seen = (counts > 0) | meta.prompt_token_mask
        rep = meta.repetition_penalties[:, None]
        # Repetition penalty (CTRL): shrink positive logits, grow negative ones.
        penalised = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen, penalised, logits)
        logits = logits - meta.frequency_penalties[:, None] * counts
        return logits - meta.presence_penalties[:, None] * (counts > 0).to(logits.dtype)

    def _sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = argmax_rows(logits, self.native)
        temperature = torch.where(meta.temperature > 0, meta.temperature, torch.ones_like(meta.temperature))
        logits = logits / temperature[:, None]
        if meta.top_k is not None:
            kth = logits.topk(int(meta.top_k.max()), dim=-1).values  # [N, max_k]
            threshold = kth.gather(1, (meta.top_k - 1).clamp(min=0)[:, None])
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if meta.min_p is not None:
            floor = probs.max(dim=-1, keepdim=True).values * meta.min_p[:, None]
            probs = probs.masked_fill(probs < floor, 0.0)
        if meta.top_p is not None:
            probs = _top_p(probs, meta.top_p)
        q = torch.empty_like(probs).uniform_()  # [N, V]
        for row, generator in meta.generators.items():
            q[row].uniform_(generator=generator)
        q.log_().neg_()  # Exp(1)
        sampled = argmax_rows(probs.div_(q), self.native)  # probs: this function's own tensor
        return torch.where(meta.temperature > 0, sampled, greedy)


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches top_p."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before > top_p[:, None] * sorted_probs.sum(-1, keepdim=True), 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def gather_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: int) -> list[LogprobsEntry]:
    """logprobs [N, V]; token_ids [N]: the token each entry is about, then the top-`num_top`."""
    chosen = logprobs.gather(1, token_ids[:, None])  # [N, 1]
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    top_values, top_ids = logprobs.topk(num_top, dim=-1) if num_top > 0 else (chosen[:, :0], token_ids[:, None][:, :0])
    ids = torch.cat([token_ids[:, None], top_ids], dim=1).tolist()
    values = torch.cat([chosen, top_values], dim=1).tolist()
    return [LogprobsEntry(i, v, r) for i, v, r in zip(ids, values, ranks.tolist())]
