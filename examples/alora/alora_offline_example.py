"""Activated LoRA offline: the base model answers, then a "certainty" aLoRA judges the
answer on the same conversation, reusing the base model's KV cache.

    python examples/alora/alora_offline_example.py                       # default model, random demo adapter
    python examples/alora/alora_offline_example.py --model PATH --adapter PATH --invocation TEXT

Without --adapter, a random (untrained) certainty aLoRA is written for the default
model, so its answer is noise; train a real one with examples/alora/train_alora.py.
What to look at is the cached-token count and the two times to first token: the
intrinsic only computes the invocation tokens, not the conversation.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest

DEFAULT_INVOCATION = "<|im_start|>certainty\n"


def write_demo_adapter(llm: LLM, invocation: str, path: str) -> str:
    """An untrained rank-8 aLoRA saved by PEFT, whose invocation is `invocation`."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir = llm.llm_engine.model_config.model_dir
    tokens = llm.get_tokenizer().encode(invocation, add_special_tokens=False)
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj"], task_type="CAUSAL_LM",
                        alora_invocation_tokens=tokens, init_lora_weights=False)
    get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), config).save_pretrained(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--adapter", default=None, help="a PEFT aLoRA folder (default: a random demo adapter)")
    parser.add_argument("--invocation", default=DEFAULT_INVOCATION,
                        help="the adapter's invocation string, appended to the conversation")
    args = parser.parse_args()

    llm = LLM(model=args.model, enable_lora=True, enable_activated_lora=True, max_lora_rank=64, max_model_len=4096)
    adapter = args.adapter or write_demo_adapter(llm, args.invocation, os.path.join(tempfile.mkdtemp(), "certainty"))
    certainty = LoRARequest("certainty", 1, adapter)
    tokenizer = llm.get_tokenizer()

    question = ("A train leaves at 9:40 and the journey takes 2 hours and 35 minutes. "
                "At what time does it arrive? Explain briefly.")
    conversation = [{"role": "user", "content": question}]
    base = llm.chat(conversation, SamplingParams(temperature=0, max_tokens=96), use_tqdm=False)[0]
    answer = base.outputs[0].text
    print(f"Base model answer:\n  {answer.strip()}\n")

    # The intrinsic sees the conversation with the answer, then its invocation.
    conversation.append({"role": "assistant", "content": answer})
    prompt = tokenizer.apply_chat_template(conversation, tokenize=False) + args.invocation
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    alora = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8),
                         lora_request=certainty, use_tqdm=False)[0]

    # For comparison, the same intrinsic call on a cold cache computes the whole prompt.
    llm.llm_engine.engine_core.reset_prefix_cache()
    cold = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8),
                        lora_request=certainty, use_tqdm=False)[0]

    print(f"Certainty intrinsic output: {alora.outputs[0].text!r}")
    print(f"Prompt tokens: {len(ids)}, served from the base model's cache: {alora.num_cached_tokens}")
    print(f"Time to first token, base turn:                {base.metrics.time_to_first_token * 1000:8.1f} ms")
    print(f"Time to first token, aLoRA (base KV reused):   {alora.metrics.time_to_first_token * 1000:8.1f} ms")
    print(f"Time to first token, aLoRA on a cold cache:    {cold.metrics.time_to_first_token * 1000:8.1f} ms")
    assert alora.outputs[0].token_ids == cold.outputs[0].token_ids, "cache reuse must not change the output"


if __name__ == "__main__":
    main()
