"""Batch-1 decode against llama.cpp: the same GGUF file, the same machine, the same threads.

    pip install llama-cpp-python        # not an engine dependency; builds llama.cpp for this CPU
    python -m benchmarks.against_llama_cpp --types Q4_0 Q8_0 BF16 --threads 1 2
    python -m benchmarks.against_llama_cpp --llama-1b-shapes --types Q4_0 Q8_0

The packaged SmolLM2-135M-Instruct (or --model, a Llama/Qwen2 folder) is written as one GGUF
file per --types entry (tests/utils/gguf_files.py: llama.cpp's converter's names and rotary
order), its linears in that type and its embedding, which is also its LM head, in Q8_0 for the
quantized types (llama.cpp keeps the output matrix at 6-8 bits in Q4 files too) or in the
type itself for BF16 / F16. Both engines then load that one file: the engine as `model=`,
llama.cpp through llama-cpp-python. Both keep a 16-bit KV cache (llama.cpp's default f16; the
engine's `--kv-cache-dtype bfloat16`) and decode greedily, one sequence of `--context` prompt
tokens. dtype="auto" on both sides: llama.cpp computes in fp32; the engine runs quantized files
in fp32 and BF16 / F16 files in bf16 where the CPU has native bf16.

A decode step is timed as a user sees it: for the engine, `LLMEngine.step()` (schedule, the
forward, greedy sampling, detokenizing); for llama.cpp, `Llama.eval([token])` (the forward)
and numpy's argmax over its logits. The two engines take turns for --rounds rounds, each
round timing --steps steps of each, so a slow minute of a shared host slows both alike; the
ratio column is the median of the rounds' own ratios. Before timing, both decode
--check-tokens tokens greedily from a short chat request (CHECK_REQUEST), and so does the
engine on the original checkpoint in fp32: the table gives the leading tokens each pair shares
(engines / engine and fp32 / llama.cpp and fp32). The engines round differently, so a
divergence between near-equal logits is possible; quantized files move away from fp32 alike.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import argparse
import tempfile
import time
from statistics import median

import numpy as np

from benchmarks.common import (
    conversation_ids,
    load_hf_config,
    load_line,
    machine_load,
    print_table,
    save_json,
)
from vllm import LLM, SamplingParams

TYPES = ("Q4_0", "Q8_0", "Q4_K_M", "BF16", "F16")
CHECK_REQUEST = ("Write a short story about a lighthouse keeper who finds a message in a bottle. Describe the "
                 "sea, the weather and what the message says.")


def gguf_types(linear_type: str, num_layers: int):
    """`write_gguf`'s type choice: the linears in `linear_type`; the embedding (the tied LM head)
    and any separate output matrix in Q8_0 for quantized files, else in the file's own type.
    Q4_K_M is llama.cpp's recipe: Q6_K for the head and for attn_v / ffn_down of the layers where
    llama.cpp spends more bits (the first and last eighth, every third between), Q4_K elsewhere."""
    from gguf import GGMLQuantizationType as T

    if linear_type == "Q4_K_M":
        return lambda name, w: q4_k_m_type(name, num_layers)
    linear, head = getattr(T, linear_type), T.Q8_0 if linear_type.startswith("Q") else getattr(T, linear_type)
    return lambda name, w: head if name.startswith(("token_embd", "output.")) else linear


def q4_k_m_type(name: str, num_layers: int):
    from gguf import GGMLQuantizationType as T

    if name.startswith(("token_embd", "output.")):
        return T.Q6_K
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer, eighth = int(name.split(".")[1]), num_layers // 8
        more_bits = layer < eighth or layer >= num_layers - eighth or (layer - eighth) % 3 == 2
        return T.Q6_K if more_bits else T.Q4_K
    return T.Q4_K


def write_file(model_dir: str, linear_type: str, folder: str) -> str:
    from tests.utils.gguf_files import write_gguf

    config = load_hf_config(model_dir)
    if linear_type == "Q4_K_M" and (config.hidden_size % 256 or config.intermediate_size % 256):
        raise ValueError(f"Q4_K_M needs layer input sizes that are multiples of 256 (K-quant blocks); this model "
                         f"has {config.hidden_size} and {config.intermediate_size}: try --llama-1b-shapes")
    name = os.path.basename(model_dir.rstrip("/"))
    path = os.path.join(folder, f"{name}-{linear_type}.gguf")
    return write_gguf(model_dir, path, gguf_types(linear_type, config.num_hidden_layers), name=name)


class LlamaCpp:
    """llama-cpp-python's low-level decode: one token per `eval`, greedy by argmax."""

    def __init__(self, path: str, threads: int, n_ctx: int):
        from llama_cpp import Llama

        self.llm = Llama(model_path=path, n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                         n_batch=512, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def prefill(self, prompt: list[int]) -> int:
        self.llm.reset()
        self.llm.eval(prompt)
        return self._greedy()

    def step(self, token: int) -> int:
        self.llm.eval([token])
        return self._greedy()

    def _greedy(self) -> int:  # the last token's logits, read where llama.cpp left them
        return int(np.argmax(np.ctypeslib.as_array(self.llm._ctx.get_logits(), shape=(self.n_vocab,))))

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        tokens = [self.prefill(prompt)]
        while len(tokens) < n:
            tokens.append(self.step(tokens[-1]))
        return tokens

    def step_seconds(self, prompt: list[int], steps: int) -> float:
        token = self.prefill(prompt)
        times = []
        for _ in range(steps):
            start = time.perf_counter()
            token = self.step(token)
            times.append(time.perf_counter() - start)
        return median(times)


class Engine:
    """This engine on the same file: one request's decode steps through `LLMEngine.step()`."""

    def __init__(self, path: str, threads: int, n_ctx: int):
        self.llm = LLM(path, cpu_threads=threads, kv_cache_dtype="bfloat16", max_model_len=n_ctx,
                       kv_cache_memory_bytes=256 << 20)

    def greedy(self, prompt: list[int], n: int) -> list[int]:
        params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
        out = self.llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
        return list(out[0].outputs[0].token_ids)

    def step_seconds(self, prompt: list[int], steps: int) -> float:
        engine = self.llm.llm_engine
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        engine.add_request(f"llama-cpp-cmp-{time.monotonic_ns()}", {"prompt_token_ids": prompt}, params)
        engine.step()  # the prefill and the first token
        times = []
        while engine.has_unfinished_requests():
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        return median(times)


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy decodes share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def check_prompt(tokenizer, vocab_size: int) -> list[int]:
    """The greedy check's prompt: a plain request in the model's chat markup (clear next-token
    margins, unlike random tokens), or random tokens for a model without a chat template."""
    if not getattr(tokenizer, "chat_template", None):
        return conversation_ids(tokenizer, vocab_size, 64, seed=11)
    text = tokenizer.apply_chat_template([{"role": "user", "content": CHECK_REQUEST}], add_generation_prompt=True,
                                         tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def compare(path: str, threads: int, prompt: list[int], check: list[int], reference: list[int], args) -> dict:
    n_ctx = max(len(prompt) + args.steps, len(check) + args.check_tokens) + 16
    ours, theirs = Engine(path, threads, n_ctx), LlamaCpp(path, threads, n_ctx)
    mine, llama_cpps = ours.greedy(check, args.check_tokens), theirs.greedy(check, args.check_tokens)
    agree = {"engines": agreeing_prefix(mine, llama_cpps),
             "engine_and_full_precision": agreeing_prefix(mine, reference),
             "llama_cpp_and_full_precision": agreeing_prefix(llama_cpps, reference)}
    times = {"engine": [], "llama.cpp": []}
    for _ in range(args.rounds):
        times["engine"].append(ours.step_seconds(prompt, args.steps))
        times["llama.cpp"].append(theirs.step_seconds(prompt, args.steps))
    ratio = median([a / b for a, b in zip(times["engine"], times["llama.cpp"])])
    del ours, theirs
    return {"ms": {k: [t * 1000 for t in v] for k, v in times.items()}, "engine_over_llama_cpp": ratio,
            "greedy_tokens_agreeing": agree, "greedy_tokens_checked": args.check_tokens}


def llama_1b_shapes(folder: str) -> str:
    """A random Llama with Llama-3.2-1B's layers (16 of hidden 2048, MLP 8192, 32 query and 8 KV
    heads of 64) and the tests' small tokenizer: a 1B-class model's decode without a download."""
    from tests.utils.checkpoints import make_checkpoint

    return make_checkpoint(os.path.join(folder, "llama-1b-shapes"), "llama", seed=5, hidden_size=2048,
                           intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                           num_key_value_heads=8, head_dim=64, max_position_embeddings=4096)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Llama/Qwen2 HF folder (default: the packaged SmolLM2)")
    parser.add_argument("--llama-1b-shapes", action="store_true",
                        help="a random Llama with Llama-3.2-1B's layer shapes instead (written here, ~4 GB in fp32)")
    parser.add_argument("--types", nargs="+", default=["Q4_0", "Q8_0", "BF16"], choices=TYPES,
                        help="the linears' GGUF type, one file each")
    parser.add_argument("--threads", nargs="+", type=int, default=[1], help="threads of both engines")
    parser.add_argument("--context", type=int, default=512, help="prompt tokens before the timed decode")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per engine and round")
    parser.add_argument("--rounds", type=int, default=7,
                        help="turns of both engines (on a shared VM 3 rounds let one slow round decide a median)")
    parser.add_argument("--check-tokens", type=int, default=16, help="greedy tokens compared before timing")
    parser.add_argument("--json", default=None, help="write results to this JSON file")
    args = parser.parse_args()
    try:
        import llama_cpp
    except ImportError:
        parser.exit(2, "llama-cpp-python is not installed: pip install llama-cpp-python (it builds llama.cpp)\n")
    from vllm.model_executor.default_model import ensure_default_model
    from vllm.tokenizer import get_tokenizer

    results = {"machine": machine_load(), "llama_cpp_python": llama_cpp.__version__, "context": args.context}
    rows = []
    with tempfile.TemporaryDirectory(prefix="vllm-llama-cpp-") as folder:
        model_dir = args.model or (llama_1b_shapes(folder) if args.llama_1b_shapes else ensure_default_model())
        hf_config = load_hf_config(model_dir)
        tokenizer = get_tokenizer(model_dir)
        prompt = conversation_ids(tokenizer, hf_config.vocab_size, args.context, seed=7)
        check = check_prompt(tokenizer, hf_config.vocab_size)
        full = LLM(model_dir, dtype="float32", max_model_len=len(check) + args.check_tokens + 16)
        reference = list(full.generate({"prompt_token_ids": check}, SamplingParams(
            temperature=0, max_tokens=args.check_tokens, ignore_eos=True), use_tqdm=False)[0].outputs[0].token_ids)
        del full
        for linear_type in args.types:
            path = write_file(model_dir, linear_type, folder)
            for threads in args.threads:
                r = compare(path, threads, prompt, check, reference, args)
                results[f"{linear_type}/{threads}"] = r
                agree = r["greedy_tokens_agreeing"]
                rows.append((linear_type, threads, f"{median(r['ms']['engine']):.2f}",
                             f"{median(r['ms']['llama.cpp']):.2f}", f"{r['engine_over_llama_cpp']:.2f}",
                             f"{agree['engines']} / {agree['engine_and_full_precision']} / "
                             f"{agree['llama_cpp_and_full_precision']} of {args.check_tokens}"))
    print_table(f"Batch-1 decode step ({args.context} ctx), {hf_config.architectures[0]}, {args.rounds} rounds "
                f"in turns, llama-cpp-python {llama_cpp.__version__}",
                rows, ("linears", "threads", "engine ms", "llama.cpp ms", "engine / llama.cpp",
                      "greedy: engines / engine, fp32 / llama.cpp, fp32"))
    results["machine_after"] = machine_load()
    print(f"{load_line(results['machine'])}; after: {load_line(results['machine_after'])}")
    save_json(args.json, results)


if __name__ == "__main__":
    main()
