"""Greedy reference generations from transformers / PEFT models (the oracles)."""

from __future__ import annotations

import torch


@torch.no_grad()
def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy tokens and their logprobs for one prompt, from an HF or PEFT model.

    Exactly `max_new_tokens` tokens: EOS neither stops it nor is masked (an id past the
    vocabulary stands in as the stop token), the same as `ignore_eos=True`. PEFT computes
    aLoRA offsets from `input_ids` inside `generate`, so an aLoRA switches on at the last
    invocation occurrence exactly as PEFT defines it.
    """
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
