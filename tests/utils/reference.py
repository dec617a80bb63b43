"""Greedy reference generations from transformers / PEFT models (the oracles)."""

from __future__ import annotations

import inspect
from typing import Optional

import torch
from transformers import DynamicCache


class RoundedCache(DynamicCache):
    """A transformers KV cache that stores keys and values rounded to `dtype` (and hands
    attention those, widened back): the oracle of the engine's --kv-cache-dtype, whose
    attention reads keys and values as its cache holds them, a prompt's own included.

    `unrounded[layer_idx]` keeps each layer's keys and values as computed, before rounding
    ([2, 1, num_kv_heads, num_tokens, head_dim]), so a test can tell a rounding-boundary flip
    (an fp32 value next to the midpoint between two bf16 values) from a wrong value."""

    def __init__(self, dtype: torch.dtype, **kwargs):
        super().__init__(**kwargs)
        self.stored_dtype = dtype
        self.unrounded: dict[int, torch.Tensor] = {}

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        def rounded(x):
            return x.to(self.stored_dtype).to(x.dtype)

        new = torch.stack([key_states, value_states])
        old = self.unrounded.get(layer_idx)
        self.unrounded[layer_idx] = new if old is None else torch.cat([old, new], dim=3)
        return super().update(rounded(key_states), rounded(value_states), layer_idx, *args, **kwargs)


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int,
              kv_cache_dtype: Optional[torch.dtype] = None,
              cache: Optional[RoundedCache] = None) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs for one prompt, from an HF or PEFT model.

    Exactly `max_new_tokens` tokens: EOS neither stops it nor is masked (an id past the
    vocabulary stands in as the stop token), the same as `ignore_eos=True`. PEFT computes
    aLoRA offsets from `input_ids` inside `generate`, so an aLoRA switches on at the last
    invocation occurrence exactly as PEFT defines it. `kv_cache_dtype`: keys and values
    rounded to it as they are cached (RoundedCache); or `cache`, a RoundedCache the caller keeps.
    """
    if cache is None and kv_cache_dtype is not None:
        cache = RoundedCache(kv_cache_dtype)
    never = model.config.get_text_config().vocab_size + 1
    out = model.generate(
        input_ids=torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        eos_token_id=never,
        pad_token_id=never,
        do_sample=False,
        output_logits=True,
        return_dict_in_generate=True,
        cache=cache,
    )
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    # Raw logits: `scores` would be after any logits processors.
    logprobs = [torch.log_softmax(s[0].float(), -1)[t].item() for s, t in zip(out.logits, tokens)]
    return tokens, logprobs


@torch.no_grad()
def hf_prompt_logprobs(model, prompt_ids: list[int]) -> list[float]:
    """Logprob of each prompt token after the first, given the tokens before it."""
    logits = model(torch.tensor([prompt_ids])).logits[0].float()
    logprobs = torch.log_softmax(logits, -1)
    return [logprobs[i, prompt_ids[i + 1]].item() for i in range(len(prompt_ids) - 1)]


@torch.no_grad()
def hf_incremental_logits(model, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    """Logits as transformers generates: ids[:prefill] in one pass, then each later token alone
    over the KV cache the passes before it left. [len(ids), vocab]: the first pass's rows, then
    one row a step.

    transformers 5.24 renamed forward's `past_key_values` to `cache` (the output's field too);
    the old name is deprecated, so the name the installed version takes is used."""
    cache_arg = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    out = model(ids[None, :prefill], use_cache=True)
    logits = [out.logits[0]]
    for p in range(prefill, len(ids)):
        out = model(ids[None, p : p + 1], use_cache=True, **{cache_arg: out[cache_arg]})
        logits.append(out.logits[0])
    return torch.cat(logits)
