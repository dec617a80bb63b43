"""Train a small Activated LoRA (aLoRA) "sentiment" intrinsic for SmolLM2-135M-Instruct.

Append an empty `{"role": "sentiment", "content": ""}` turn to any conversation: the chat
template renders its header `<|im_start|>sentiment\\n`, the adapter's invocation, and
the adapter answers the sentiment of the user's messages as the next assistant turn,
`positive` or `negative` followed by `<|im_end|>`. The training data is made here,
deterministically, from templated reviews with clearly positive or negative words; the
loss covers only the answer tokens. The result is saved with PEFT's `save_pretrained`, so
its adapter_config.json carries `alora_invocation_tokens`, and
`vllm serve --enable-lora --enable-activated-lora --lora-modules sentiment=DIR` serves it.

An aLoRA leaves every position before its invocation on the base weights, so the
conversation's KV cache is exactly the base model's. The server uses that to reuse the
cache of the base turn; training here uses it too: each step runs the conversation
through the base model once without gradients and trains only on the few tokens from
the invocation on, which takes about half the compute of a forward and backward pass
over the whole sequence.

    python examples/alora/train_alora.py --output-dir sentiment-alora
"""

from __future__ import annotations

import argparse
import inspect
import json
import random
import time
from typing import Optional

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

INVOCATION = "<|im_start|>sentiment\n"
INTRINSIC_TURN = {"role": "sentiment", "content": ""}
LABELS = ("positive", "negative")
TARGET_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]

SUBJECTS = [
    "the new phone", "this restaurant", "the hotel", "the movie", "the new laptop", "the customer support",
    "the concert", "this book", "the delivery", "the coffee shop", "the museum tour", "the software update",
    "the train ride", "the yoga class", "the wireless headphones", "the city tour",
]
WORDS = {
    "positive": ["amazing", "wonderful", "fantastic", "excellent", "delightful", "great", "superb", "lovely"],
    "negative": ["terrible", "awful", "disappointing", "horrible", "dreadful", "frustrating", "poor", "useless"],
}
DETAILS = {
    "positive": ["I would happily recommend it to my friends.", "Everything worked perfectly.",
                 "It made my whole week.", "I can't wait to do it again.", "The people there were so kind."],
    "negative": ["I regret spending money on it.", "Nothing worked the way it should.",
                 "It ruined my whole week.", "I will never do it again.", "The people there were rude."],
}
REVIEWS = [
    "I just tried {subject} and it was {word}. {detail}",
    "Honestly, {subject} was {word}. {detail}",
    "{detail} Overall, {subject} was {word}.",
    "My experience with {subject} was {word}. {detail}",
    "Can I tell you about {subject}? It was {word}. {detail}",
]
# Replies in the base model's register that do not give the label away, so the adapter
# learns to read the user's words rather than the assistant's.
REPLIES = [
    "Thank you for sharing your experience with {subject}.",
    "Thanks for telling me about {subject}. Is there anything else I can help you with?",
    "I understand. How else can I help you today?",
    "Noted! Let me know if you have any questions about {subject}.",
]


def make_conversations(n: int, seed: int) -> list[tuple[list[dict], str]]:
    """`n` (messages, label) pairs: a user's review, usually followed by an assistant reply."""
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        label = rng.choice(LABELS)
        subject = rng.choice(SUBJECTS)
        review = rng.choice(REVIEWS).format(subject=subject, word=rng.choice(WORDS[label]),
                                            detail=rng.choice(DETAILS[label]))
        messages = [{"role": "user", "content": review[0].upper() + review[1:]}]
        # Some conversations end at the user's turn: the intrinsic may be asked at any point.
        if rng.random() < 0.8:
            messages.append({"role": "assistant", "content": rng.choice(REPLIES).format(subject=subject)})
        examples.append((messages, label))
    return examples


def sentiment_prompt(tokenizer, messages: list[dict]) -> str:
    """The conversation, an empty "sentiment" turn and the generation prompt, as the chat
    template renders them: `...<|im_start|>sentiment\\n<|im_end|>\\n<|im_start|>assistant\\n`.

    The sentiment turn's header is the invocation; the adapter then answers as the
    assistant. This is what a plain chat request renders (add_generation_prompt is on by
    default), so any OpenAI client can call the intrinsic without extra options.
    """
    return tokenizer.apply_chat_template(messages + [INTRINSIC_TURN], add_generation_prompt=True, tokenize=False)


def invocation_tokens(tokenizer) -> list[int]:
    # The invocation starts with a special token, so BPE cannot merge it with the text
    # before it and these ids appear verbatim in every rendered prompt.
    return tokenizer.encode(INVOCATION, add_special_tokens=False)


def answer_tokens(tokenizer, label: str) -> list[int]:
    return tokenizer.encode(label + tokenizer.eos_token, add_special_tokens=False)


def _invocation_start(ids: list[int], invocation: list[int]) -> int:
    """Index of the last occurrence of `invocation` in `ids`, where the adapter switches on."""
    n = len(invocation)
    start = max((i for i in range(len(ids) - n + 1) if ids[i:i + n] == invocation), default=None)
    if start is None:
        raise ValueError(f"The chat template did not render the invocation {INVOCATION!r}: this example "
                         "needs a ChatML template (<|im_start|>role ... <|im_end|>).")
    return start


def _answer_logits(model: PeftModel, tokenizer, batch: list[tuple[list[dict], str]]):
    """(logits that predict each answer token, the answer tokens), given the rendered
    prompt, with teacher forcing.

    Each prompt is split where the adapter switches on. The conversations before that go
    through the base model without gradients (the adapter is off there anyway), left-padded
    so that every row's KV cache ends at the same column; the rest of the prompt and the
    answer then run with the adapter on top of that cache.
    """
    invocation = invocation_tokens(tokenizer)
    prompts = [tokenizer.encode(sentiment_prompt(tokenizer, m), add_special_tokens=False) for m, _ in batch]
    starts = [_invocation_start(p, invocation) for p in prompts]
    prefixes = [p[:start] for p, start in zip(prompts, starts)]
    suffixes = [p[start:] + answer_tokens(tokenizer, label) for p, start, (_, label) in zip(prompts, starts, batch)]
    assert len(set(map(len, suffixes))) == 1, "labels must have the same number of tokens"

    width = max(map(len, prefixes))
    prefix_ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in prefixes])
    prefix_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prefixes])
    # Positions count real tokens only, so a left-padded row sees the same rotary
    # positions as it would unpadded (and as the engine gives it).
    prefix_positions = (prefix_mask.cumsum(-1) - 1).clamp(min=0)
    base = model.get_base_model()
    # transformers 5.24 renamed the KV-cache argument `past_key_values` to `cache`.
    cache_arg = "cache" if "cache" in inspect.signature(type(base).forward).parameters else "past_key_values"
    with torch.no_grad(), model.disable_adapter():
        cache = getattr(base.model(input_ids=prefix_ids, attention_mask=prefix_mask, position_ids=prefix_positions,
                                   use_cache=True), cache_arg)

    suffix_ids = torch.tensor(suffixes)
    mask = torch.cat([prefix_mask, torch.ones_like(suffix_ids)], dim=1)
    positions = prefix_mask.sum(-1, keepdim=True) + torch.arange(suffix_ids.shape[1])
    # PEFT finds the invocation at the start of `suffix_ids`, so the adapter covers all of it.
    logits = model(input_ids=suffix_ids, attention_mask=mask, position_ids=positions, **{cache_arg: cache}).logits
    # The logits at the prompt's last token and at each answer token but the last
    # predict the answer.
    n = len(answer_tokens(tokenizer, batch[0][1]))
    return logits[:, -n - 1:-1].float(), suffix_ids[:, -n:]


def answer_loss(model: PeftModel, tokenizer, batch: list[tuple[list[dict], str]]) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens (the only tokens with a loss)."""
    logits, targets = _answer_logits(model, tokenizer, batch)
    return torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets)


@torch.no_grad()
def accuracy(model: PeftModel, tokenizer, examples: list[tuple[list[dict], str]], batch_size: int = 8) -> float:
    """Share of examples for which greedy decoding gives exactly the right answer: the
    label, then the end of the turn."""
    model.eval()
    right = 0
    for i in range(0, len(examples), batch_size):
        logits, targets = _answer_logits(model, tokenizer, examples[i:i + batch_size])
        right += (logits.argmax(-1) == targets).all(-1).sum().item()
    return right / len(examples)


def train(
    output_dir: str,
    steps: int = 20,
    batch_size: int = 8,
    lr: float = 1e-3,
    rank: int = 8,
    seed: int = 0,
    model: Optional[str] = None,
    log_every: int = 5,
) -> dict:
    """Train the sentiment aLoRA, save it to `output_dir`, and return a summary
    (final loss, held-out accuracy, seconds spent training)."""
    if model is None:
        from vllm.model_executor.default_model import ensure_default_model

        model = ensure_default_model()
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(model)
    base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    config = LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        lora_dropout=0.0,
        target_modules=TARGET_MODULES,
        alora_invocation_tokens=invocation_tokens(tokenizer),
        task_type="CAUSAL_LM",
    )
    peft_model = get_peft_model(base, config)
    optimizer = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=lr)
    # Decay to zero so the last steps settle instead of bouncing around.
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 - step / steps)

    train_set = make_conversations(steps * batch_size, seed)
    held_out = make_conversations(48, seed + 1)  # drawn apart from the training conversations
    print(f"Training an aLoRA (rank {rank}) on {len(train_set)} conversations, invocation "
          f"{INVOCATION!r} = {config.alora_invocation_tokens}")
    peft_model.train()
    start = time.perf_counter()
    recent = []
    for step in range(steps):
        batch = train_set[step * batch_size:(step + 1) * batch_size]
        loss = answer_loss(peft_model, tokenizer, batch)
        loss.backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        recent.append(loss.item())
        if (step + 1) % log_every == 0 or step + 1 == steps:
            print(f"step {step + 1:4d}/{steps}  loss {sum(recent) / len(recent):.4f}  "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            recent = []
    seconds = time.perf_counter() - start
    final_loss = loss.item()

    held_out_accuracy = accuracy(peft_model, tokenizer, held_out)
    peft_model.save_pretrained(output_dir)
    print(f"Trained in {seconds:.0f} s; final loss {final_loss:.4f}; held-out accuracy "
          f"{held_out_accuracy:.0%} on {len(held_out)} conversations. Saved to {output_dir}")
    return {"final_loss": final_loss, "held_out_accuracy": held_out_accuracy, "seconds": seconds}


def main(argv: Optional[list[str]] = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", required=True, help="Where to save the PEFT adapter.")
    parser.add_argument("--steps", type=int, default=20, help="Optimizer steps (one fresh batch each).")
    parser.add_argument("--batch-size", type=int, default=8, help="Conversations per step.")
    parser.add_argument("--lr", type=float, default=1e-3, help="Peak learning rate (linear decay to 0).")
    parser.add_argument("--rank", type=int, default=8, help="LoRA rank (alpha = 2 * rank).")
    parser.add_argument("--seed", type=int, default=0, help="Seed of the data and the initial weights.")
    parser.add_argument("--model", default=None,
                        help="Base model with a ChatML chat template, folder or hub id "
                             "(default: the engine's SmolLM2-135M-Instruct).")
    args = parser.parse_args(argv)
    summary = train(args.output_dir, steps=args.steps, batch_size=args.batch_size, lr=args.lr, rank=args.rank,
                    seed=args.seed, model=args.model)
    print(f"""
Serve it next to the base model:
    vllm serve{' ' + args.model if args.model else ''} --enable-lora --enable-activated-lora --max-lora-rank {args.rank} \\
        --lora-modules sentiment={args.output_dir}
and ask it about any conversation: send the conversation plus a final
{json.dumps(INTRINSIC_TURN)} message to model="sentiment" (see examples/alora/README.md).""")
    return summary


if __name__ == "__main__":
    main()
