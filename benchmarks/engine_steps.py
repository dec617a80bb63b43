"""The engine end to end, one table: decode step at batch 1 and 64, a 2,048-token
prefill, aLoRA and plain-LoRA time to first token after a 2,048-token base conversation
with a 16-token invocation, and decode throughput of a batch mixing base, LoRA and aLoRA
requests against base only. Each figure with its ratio to this machine's floor.

    python -m benchmarks.engine_steps                       # CPU, default ~135M model
    python -m benchmarks.engine_steps --granite-8b-dummy    # GPU (H200), Granite-3.3-8B shapes, bf16

Floors (benchmarks.common.Floor): a decode step reads every weight once plus the KV of
the batch at the measured copy bandwidth, or costs the batch's FLOPs at the measured
matmul rate, whichever is slower; a prefill costs its FLOPs at the matmul rate.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import tempfile
import time

from benchmarks.common import (
    ALL_TARGETS,
    Floor,
    add_model_args,
    conversation_ids,
    default_device,
    engine_dtype,
    load_hf_config,
    machine_load,
    print_table,
    resolve_model,
    save_json,
    sync,
    write_adapter_pair,
)
from vllm import LLM, SamplingParams
from vllm.lora.request import LoRARequest


def decode_step_seconds(llm: LLM, batch: int, context: int, device: str, lora_requests=None) -> float:
    """Median wall time of a decode step with `batch` sequences of `context` tokens."""
    engine = llm.llm_engine
    vocab = engine.model_config.vocab_size
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i in range(batch):
        prompt = conversation_ids(engine.get_tokenizer(), vocab, context, seed=1000 + i)
        lora = lora_requests[i % len(lora_requests)] if lora_requests else None
        if lora is not None and "alora" in lora.lora_name:
            prompt = prompt + lora_requests.invocation
        engine.add_request(f"d{batch}-{i}-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params,
                           lora_request=lora)
    while any(len(o.outputs[0].token_ids) == 0 for o in engine.step()) or _prefilling(engine):
        pass  # run the prefills (and the first token) before timing decode
    times = []
    while engine.has_unfinished_requests():
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def _prefilling(engine) -> bool:
    scheduler = engine.engine_core.scheduler
    return bool(scheduler.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)


class AdapterRequests(list):
    """LoRA requests plus the aLoRA invocation their prompts end with."""

    invocation: list[int] = []


def ttft(llm: LLM, prompt: list[int], lora: LoRARequest | None) -> tuple[float, int]:
    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=1),
                       lora_request=lora, use_tqdm=False)[0]
    return out.metrics.time_to_first_token, out.num_cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--context", type=int, default=2048, help="conversation / prefill tokens")
    parser.add_argument("--decode-context", type=int, default=512, help="context of the decode-step batches")
    parser.add_argument("--invocation-len", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    args = parser.parse_args()
    device = default_device()
    model_dir, kwargs = resolve_model(args)
    hf_config = load_hf_config(model_dir)
    dtype = engine_dtype(args)
    root = tempfile.mkdtemp(prefix="vllm-engine-steps-")
    llm = LLM(model_dir, max_model_len=max(4096, args.context + 64), enable_lora=True, max_loras=4,
              max_lora_rank=args.rank, **kwargs)
    tokenizer = llm.get_tokenizer()
    vocab = llm.llm_engine.model_config.vocab_size
    # A 16-token invocation: a special-token start, then ordinary tokens.
    invocation = tokenizer.encode("<|im_start|>", add_special_tokens=False)
    invocation += conversation_ids(tokenizer, vocab, args.invocation_len + 8, seed=7)[-args.invocation_len:]
    invocation = invocation[: args.invocation_len]
    alora_dir, lora_dir = write_adapter_pair(root, hf_config, "certainty", args.rank, ALL_TARGETS, 0, invocation, dtype)
    alora, lora = LoRARequest("alora-certainty", 1, alora_dir), LoRARequest("lora-certainty", 2, lora_dir)
    for adapter in (alora, lora):  # loaded and run once, so no timed call pays for reading an adapter
        ttft(llm, conversation_ids(tokenizer, vocab, 64, seed=3) + invocation, adapter)
    floor = Floor(hf_config, dtype, device)
    rows, results = [], {"device": device, "machine": machine_load(), "floor": floor.as_dict()}

    def add(name: str, seconds: float, floor_seconds: float) -> None:
        rows.append((name, f"{seconds * 1000:.2f}", f"{floor_seconds * 1000:.2f}", f"{seconds / floor_seconds:.2f}"))
        results[name] = {"ms": seconds * 1000, "floor_ms": floor_seconds * 1000}

    decode_context = args.decode_context

    def decode_floor(batch: int) -> float:
        """Weights and the batch's KV read once, or the batch's FLOPs, whichever is slower."""
        return floor.decode_seconds([decode_context] * batch)

    for batch in (1, 64):
        step = decode_step_seconds(llm, batch, decode_context, device)
        add(f"decode step, batch {batch} ({decode_context} ctx)", step, decode_floor(batch))

    conversation = conversation_ids(tokenizer, vocab, args.context, seed=1)
    llm.llm_engine.engine_core.reset_prefix_cache()
    seconds, _ = ttft(llm, conversation, None)
    add(f"prefill {args.context} tokens (base turn)", seconds, floor.seconds(args.context))
    prompt = conversation + invocation
    alora_ttft, cached = ttft(llm, prompt, alora)
    add(f"aLoRA TTFT after the base turn ({cached} cached)", alora_ttft, floor.seconds(len(prompt) - cached, cached))
    lora_ttft, _ = ttft(llm, prompt, lora)
    add("plain-LoRA TTFT, same conversation", lora_ttft, floor.seconds(len(prompt)))

    mixed = AdapterRequests([None, lora, alora])
    mixed.invocation = invocation
    base_step = decode_step_seconds(llm, 63, decode_context, device)
    mixed_step = decode_step_seconds(llm, 63, decode_context, device, mixed)
    add("decode step, 63 base", base_step, decode_floor(63))
    add("decode step, 21 base + 21 LoRA + 21 aLoRA", mixed_step, decode_floor(63))
    print_table(f"Engine end to end, {device}, {hf_config.architectures[0]} {str(dtype).removeprefix('torch.')}",
                rows, ("figure", "ms", "floor ms", "x floor"))
    print(f"aLoRA TTFT is {lora_ttft / alora_ttft:.1f}x lower than plain LoRA's; "
          f"mixed-adapter decode throughput is {base_step / mixed_step:.2f} of base-only")
    results.update(alora_vs_lora_ttft=lora_ttft / alora_ttft, mixed_vs_base_decode=base_step / mixed_step)
    save_json(args.json, results)


if __name__ == "__main__":
    main()
